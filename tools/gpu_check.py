"""`make gpu-check`: what this project can only show on a GPU, in one command on a machine with one
(the python at hand, no virtual environment, no network).

1. The tests marked `gpu` (tests/gpu: the CUDA path of every layer against the CPU, bf16 training
   on the GPU against fp32 on the CPU, no host sync in the steady state under
   torch.cuda.set_sync_debug_mode("error"), recomputation and the RNG tracker, checkpoints of
   device tensors) and `compile` (--torch-compile with 2BW's weight versions).
2. benchmarks/gpu_throughput.py at GPT 125M and 1.3B (tokens/s, TFLOP/s, MFU, the transformers
   peer, memory against the planner, one layer against the planner's profile), its figures
   written to results/gpu_check.json.

One summary line per result. Without a CUDA device it says so and exits 0. Each part runs under
a time limit (TESTS_LIMIT_S, BENCHMARK_LIMIT_S: about 8 minutes together), so a hang cannot take
the whole of a short GPU session; the benchmark writes its JSON after every model, so a run cut
short keeps what it measured.
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
TESTS_LIMIT_S, BENCHMARK_LIMIT_S = 200, 280


def run_limited(command: list[str], limit_s: float, **options) -> tuple[int | None, str, str]:
    """(exit status or None when cut off at `limit_s`, stdout, stderr) of `command`."""
    try:
        done = subprocess.run(command, timeout=limit_s, **options)
        return done.returncode, done.stdout or "", done.stderr or ""
    except subprocess.TimeoutExpired as expired:
        def text(output):
            return output.decode(errors="replace") if isinstance(output, bytes) else output or ""
        return None, text(expired.stdout), text(expired.stderr)


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
        status, stdout, stderr = run_limited(
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu or compile", f"--junitxml={junit}",
             *TESTS], TESTS_LIMIT_S, cwd=ROOT, env=env, capture_output=True, text=True)
        if junit.exists():
            lines, tests_ok = test_lines(junit)
        else:
            lines, tests_ok = [], False
            print(stdout[-4000:], stderr[-4000:])
    if status is None:
        lines.append(f"test TIMEOUT the tests did not finish within {TESTS_LIMIT_S} s")
        tests_ok = False
    for line in lines:
        print(line, flush=True)
    if not tests_ok:
        print(stdout[-6000:], flush=True)
    benchmark, _, _ = run_limited([sys.executable, *BENCHMARK], BENCHMARK_LIMIT_S, cwd=ROOT,
                                  env=env)
    outcome = {0: "done (results/gpu_check.json)",
               None: f"cut off after {BENCHMARK_LIMIT_S} s (results/gpu_check.json holds the "
                     f"models it finished)"}.get(benchmark, "FAILED")
    passed = sum(line.startswith("test PASS") for line in lines)
    print(f"gpu-check: {passed}/{len(lines)} tests passed, benchmark {outcome}, "
          f"{time.time() - start:.0f} s", flush=True)
    return 0 if tests_ok and benchmark == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
