"""`make gpu-check`: what this project can only show on a GPU, in one command on a machine with one
(the python at hand, no virtual environment, no network).

1. The tests marked `gpu` (tests/gpu: the CUDA path of every layer against the CPU, bf16 training
   on the GPU against fp32 on the CPU, no host sync in the steady state under
   torch.cuda.set_sync_debug_mode("error"), recomputation and the RNG tracker, checkpoints of
   device tensors) and `compile` (--torch-compile with 2BW's weight versions).
2. benchmarks/gpu_throughput.py at GPT 125M and 1.3B (tokens/s, TFLOP/s, MFU, the transformers
   peer, memory against the planner, one layer against the planner's profile), its figures
   written to results/gpu_check.json.

One summary line per result. Without a CUDA device it says so and exits 0.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/gpu", "tests/models/test_compile.py"]
BENCHMARK = ["benchmarks/gpu_throughput.py", "--models", "125M", "1.3B", "--micro-batch-sizes",
             "4", "8", "16", "32", "--json", "results/gpu_check.json"]


def test_lines(junit: Path) -> tuple[list[str], bool]:
    """One line per test case of a JUnit report, and whether all passed."""
    lines, ok = [], True
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome = "PASS"
        for tag, label in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "SKIP")):
            element = case.find(tag)
            if element is not None:
                outcome = label
                message = (element.get("message") or "").splitlines()
                name += f": {message[0][:160]}" if message else ""
                break
        ok &= outcome in ("PASS", "SKIP")
        lines.append(f"test {outcome} {name} ({float(case.get('time', 0)):.1f} s)")
    return lines, ok


def main() -> int:
    import torch
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}): nothing "
              f"to check here; run it where a GPU is")
        return 0
    print(f"gpu-check: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    start = time.time()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp, "gpu.xml")
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu or compile",
                                f"--junitxml={junit}", *TESTS], cwd=ROOT, env=env,
                               capture_output=True, text=True)
        if junit.exists():
            lines, tests_ok = test_lines(junit)
        else:
            lines, tests_ok = [], False
            print(tests.stdout[-4000:], tests.stderr[-4000:])
    for line in lines:
        print(line, flush=True)
    if not tests_ok:
        print(tests.stdout[-6000:], flush=True)
    benchmark = subprocess.run([sys.executable, *BENCHMARK], cwd=ROOT, env=env)
    passed = sum(line.startswith("test PASS") for line in lines)
    print(f"gpu-check: {passed}/{len(lines)} tests passed, benchmark "
          f"{'done (results/gpu_check.json)' if benchmark.returncode == 0 else 'FAILED'}, "
          f"{time.time() - start:.0f} s", flush=True)
    return 0 if tests_ok and benchmark.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
