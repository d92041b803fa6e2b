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


def write_token_corpus(directory) -> None:
    """A small corpus of random token ids (below 256) as Megatron .bin/.idx train and valid
    splits, standing in for the prepared Shakespeare data."""
    import numpy as np

    from megatron_2bw.data.indexed import IndexedDatasetBuilder
    rng = np.random.RandomState(0)
    for split, documents in (("train", 4), ("valid", 2)):
        builder = IndexedDatasetBuilder(str(Path(directory) / f"{split}_text_document"), np.uint16)
        for _ in range(documents):
            tokens = rng.randint(0, 256, size=2000)
            builder.add_document(tokens, [len(tokens)])
        builder.finalize()
