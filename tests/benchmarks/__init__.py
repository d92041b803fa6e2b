"""Smoke tests of the benchmark scripts, which live outside the package (benchmarks/*.py)."""
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """Import benchmarks/<name>.py as module `name` (forked ranks' results are unpickled by
    module name, so it is registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
