"""`make gpu-check`: what this project can only show on a GPU, in one command on a machine with one
(the python at hand, no virtual environment, no network).

1. The tests marked `gpu` (tests/gpu: the CUDA path of every layer against the CPU, bf16 training
   on the GPU against fp32 on the CPU, no host sync in the steady state under
   torch.cuda.set_sync_debug_mode("error"), recomputation and the RNG tracker, checkpoints of
   device tensors) and `compile` (--torch-compile with 2BW's weight versions).
2. benchmarks/gpu_throughput.py at GPT 1.3B and 125M (tokens/s, TFLOP/s, MFU, the transformers
   peer, memory against the planner, one layer against the planner's profile), its figures
   written to results/gpu_check.json.

One summary line per result. Without a CUDA device it says so and exits 0. Each part runs under
a time limit (TESTS_LIMIT_S; BENCHMARK_LIMIT_S plus what the tests left of theirs: about 8
minutes together), so a hang cannot take the whole of a short GPU session; the benchmark writes
its JSON after every run, so a run cut short keeps what it measured. The `compile` test trains on
the CPU in forked ranks, which cannot touch CUDA once their parent has used it (and
torch.compile reads the CUDA RNG state whenever a GPU is visible): it runs in a pytest of its
own with the GPU hidden, beside the `gpu` tests.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (marker, paths, environment changes): run side by side, each in its own pytest process
TEST_PARTS = [("gpu", ["tests/gpu"], {}),
              ("compile", ["tests/models/test_compile.py"], {"CUDA_VISIBLE_DEVICES": ""})]
# 1.3B first: the targets are about it, so a benchmark cut short loses the smaller model instead
BENCHMARK = ["benchmarks/gpu_throughput.py", "--models", "1.3B", "125M", "--micro-batch-sizes",
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


def run_tests(marker: str, paths: list[str], env: dict, tmp: str) -> tuple[list[str], bool, str]:
    """(one line per test, whether all passed, the output) of the tests marked `marker`."""
    junit = Path(tmp, f"{marker}.xml")
    status, stdout, stderr = run_limited(
        [sys.executable, "-m", "pytest", "-q", "-m", marker, f"--junitxml={junit}", *paths],
        TESTS_LIMIT_S, cwd=ROOT, env=env, capture_output=True, text=True)
    try:
        lines, ok = test_lines(junit) if junit.exists() else ([], False)
    except ElementTree.ParseError:  # cut off while writing it
        lines, ok = [], False
    if status is None:
        lines.append(f"test TIMEOUT the {marker} tests did not finish within {TESTS_LIMIT_S} s")
        ok = False
    return lines, ok, stdout + stderr


def main() -> int:
    import torch
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}): nothing "
              f"to check here; run it where a GPU is")
        return 0
    print(f"gpu-check: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    start = time.time()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(TEST_PARTS)) as pool:
        parts = [pool.submit(run_tests, marker, paths, {**env, **changes}, tmp)
                 for marker, paths, changes in TEST_PARTS]
        parts = [part.result() for part in parts]
    lines = [line for part_lines, _, _ in parts for line in part_lines]
    tests_ok = all(ok for _, ok, _ in parts)
    for line in lines:
        print(line, flush=True)
    for _, ok, output in parts:
        if not ok:
            print(output[-6000:], flush=True)
    # the benchmark also gets what the tests left of their time: the same 8 minutes at most
    limit_s = BENCHMARK_LIMIT_S + max(0, round(TESTS_LIMIT_S - (time.time() - start)))
    benchmark, _, _ = run_limited([sys.executable, *BENCHMARK], limit_s, cwd=ROOT, env=env)
    outcome = {0: "done (results/gpu_check.json)",
               None: f"cut off after {limit_s} s (results/gpu_check.json holds the "
                     f"runs it finished)"}.get(
        benchmark, "FAILED (results/gpu_check.json holds the runs it finished)")
    passed = sum(line.startswith("test PASS") for line in lines)
    print(f"gpu-check: {passed}/{len(lines)} tests passed, benchmark {outcome}, "
          f"{time.time() - start:.0f} s", flush=True)
    return 0 if tests_ok and benchmark == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
