"""`make gpu-check`: what this project can only show on a GPU, in one command on a machine with one
(the python at hand, no virtual environment, no network).

1. The tests marked `gpu` (tests/gpu: the CUDA path of every layer against the CPU, bf16 training
   on the GPU against fp32 on the CPU, no host sync in the steady state under
   torch.cuda.set_sync_debug_mode("error"), recomputation and the RNG tracker, checkpoints of
   device tensors) and `compile` (--torch-compile with 2BW's weight versions).
2. Where two or more GPUs are visible, 2-process NCCL smoke runs of pretrain_gpt.py (2BW p=2,
   Flush p=2, t=2 with sequence parallelism: mock data, a few iterations), beside the tests; on
   one GPU they are skipped with one line (NCCL refuses two ranks on one device).
3. benchmarks/gpu_throughput.py at GPT 1.3B and 125M (tokens/s, TFLOP/s and MFU in both FLOP
   conventions, the transformers peer, memory against the planner, one layer against the
   planner's profile), its figures written to results/gpu_check.json.

One summary line per result. Without a CUDA device it says so and exits 0. Without pytest the
tests are skipped with one line, without transformers the benchmark's peer (what is missing is
not what a GPU check measures). Each part runs under a time limit (TESTS_LIMIT_S, the smoke runs
within it too; BENCHMARK_LIMIT_S plus what the tests left of theirs: about 8 minutes together),
so a hang cannot take the whole of a short GPU session; the benchmark writes its JSON after every
run, so a run cut short keeps what it measured. The `compile` test trains on
the CPU in forked ranks, which cannot touch CUDA once their parent has used it (and
torch.compile reads the CUDA RNG state whenever a GPU is visible): it runs in a pytest of its
own with the GPU hidden, beside the `gpu` tests.
"""
from __future__ import annotations

import importlib.util
import os
import re
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
# 2-process NCCL runs of pretrain_gpt.py where two GPUs are visible: (name, flags)
SMOKE_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--mock-data", "--vocab-size", "128", "--train-iters", "4", "--log-interval", "1",
               "--eval-iters", "0", "--distributed-timeout-minutes", "1"]
SMOKE_RUNS = [("2BW p=2", ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]),
              ("Flush p=2", ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                             "flush"]),
              ("t=2 sequence parallel", ["--tensor-model-parallel-size", "2",
                                         "--sequence-parallel"])]
SMOKE_LIMIT_S = 65  # each; the three fit in TESTS_LIMIT_S


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


def smoke_commands(backend: str = "nccl") -> list[tuple[str, list[str]]]:
    """(name, command) of each 2-process smoke run: torchrun of pretrain_gpt.py on `backend`."""
    return [(name, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", "pretrain_gpt.py", *SMOKE_MODEL, *flags,
                    "--distributed-backend", backend]) for name, flags in SMOKE_RUNS]


def run_smoke(env: dict, backend: str = "nccl") -> tuple[list[str], bool, str]:
    """(one line per smoke run, whether all passed, the failed runs' output): a run passes if it
    exits 0 having logged its last iteration. Fewer than two visible GPUs: one line saying they
    are skipped."""
    import torch
    visible = torch.cuda.device_count()
    if backend == "nccl" and visible < 2:
        return [f"smoke SKIP the 2-process NCCL runs ({', '.join(n for n, _ in SMOKE_RUNS)}) "
                f"need 2 GPUs, {visible} visible"], True, ""
    lines, ok, failed = [], True, ""
    last = SMOKE_MODEL[SMOKE_MODEL.index("--train-iters") + 1]
    for name, command in smoke_commands(backend):
        start = time.time()
        status, stdout, stderr = run_limited(command, SMOKE_LIMIT_S, cwd=ROOT, env=env,
                                             capture_output=True, text=True)
        seconds = time.time() - start
        if status is None:
            lines.append(f"smoke TIMEOUT {name}: not done within {SMOKE_LIMIT_S} s")
        elif status == 0 and re.search(rf"iteration\s+{last}/\s*{last}\b", stdout):
            lines.append(f"smoke PASS {name} ({seconds:.1f} s)")
            continue
        else:
            error = [line for line in (stderr or stdout).splitlines() if line.strip()]
            lines.append(f"smoke FAIL {name} (exit {status}): "
                         f"{error[-1][:160] if error else 'no iteration ' + last + ' logged'}")
        ok = False
        failed += f"{name}:\n{(stdout + stderr)[-3000:]}\n"
    return lines, ok, failed


def main() -> int:
    import torch
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}): nothing "
              f"to check here; run it where a GPU is")
        return 0
    print(f"gpu-check: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    start = time.time()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    have_pytest = importlib.util.find_spec("pytest") is not None
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(TEST_PARTS) + 1) as pool:
        smoke = pool.submit(run_smoke, env)
        parts = [pool.submit(run_tests, marker, paths, {**env, **changes}, tmp)
                 for marker, paths, changes in TEST_PARTS] if have_pytest else []
        parts = [part.result() for part in parts]
        smoke_lines, smoke_ok, smoke_output = smoke.result()
    lines = [line for part_lines, _, _ in parts for line in part_lines]
    tests_ok = all(ok for _, ok, _ in parts)
    if not have_pytest:
        print(f"test SKIP {', '.join(p for _, paths, _ in TEST_PARTS for p in paths)}: pytest "
              f"is not installed", flush=True)
    for line in lines + smoke_lines:
        print(line, flush=True)
    for output in [output for _, ok, output in parts if not ok] + [smoke_output]:
        if output:
            print(output[-6000:], flush=True)
    # the benchmark also gets what the tests left of their time: the same 8 minutes at most
    limit_s = BENCHMARK_LIMIT_S + max(0, round(TESTS_LIMIT_S - (time.time() - start)))
    benchmark, _, _ = run_limited([sys.executable, *BENCHMARK], limit_s, cwd=ROOT, env=env)
    outcome = {0: "done (results/gpu_check.json)",
               None: f"cut off after {limit_s} s (results/gpu_check.json holds the "
                     f"runs it finished)"}.get(
        benchmark, "FAILED (results/gpu_check.json holds the runs it finished)")
    passed = sum(line.startswith("test PASS") for line in lines)
    tests = f"{passed}/{len(lines)} tests passed" if have_pytest else "tests skipped (no pytest)"
    smoke_passed = sum(line.startswith("smoke PASS") for line in smoke_lines)
    smoke = "smoke runs skipped" if smoke_lines[0].startswith("smoke SKIP") else \
        f"{smoke_passed}/{len(smoke_lines)} smoke runs passed"
    print(f"gpu-check: {tests}, {smoke}, benchmark {outcome}, {time.time() - start:.0f} s",
          flush=True)
    return 0 if tests_ok and smoke_ok and benchmark == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
