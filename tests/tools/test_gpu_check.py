"""tools/gpu_check.py on the CPU: without a GPU it says so and exits 0; each of its parts runs
under a time limit, so a hang cannot take a short GPU session; a missing pytest skips the tests in
one line; the 2-process smoke runs are built right, run (on gloo here), and are skipped in one
line on fewer than two GPUs."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from megatron_2bw.arguments import parse_config

spec = importlib.util.spec_from_file_location(
    "gpu_check", Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_without_a_gpu_it_says_so_and_succeeds(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu_check.main() == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_a_part_that_hangs_is_cut_off_with_what_it_printed():
    status, stdout, _ = gpu_check.run_limited(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2,
        capture_output=True, text=True)
    assert status is None and stdout == "started\n"
    assert gpu_check.run_limited([sys.executable, "-c", "raise SystemExit(3)"], 30)[0] == 3


def test_the_compile_test_runs_beside_the_gpu_tests_with_the_gpu_hidden(capsys, monkeypatch):
    """Its ranks are forked, and a rank forked from a process that has used CUDA cannot touch it
    (seeding reads the CUDA RNG state, and so does torch.compile whenever a GPU is visible)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *_: "a GPU")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    runs, limits = [], []

    def run_limited(command, limit_s, **options):
        runs.append((command, options.get("env", {})))
        limits.append(limit_s)
        junit = next((c.split("=", 1)[1] for c in command if c.startswith("--junitxml=")), None)
        if junit:
            marker = command[command.index("-m", 2) + 1]
            Path(junit).write_text(f'<testsuites><testsuite><testcase classname="tests.{marker}" '
                                   f'name="test_it" time="1"/></testsuite></testsuites>')
        return 0, "", ""
    monkeypatch.setattr(gpu_check, "run_limited", run_limited)
    assert gpu_check.main() == 0
    hidden = {c[c.index("-m", 2) + 1]: env.get("CUDA_VISIBLE_DEVICES") for c, env in runs
              if "pytest" in c}
    assert hidden == {"gpu": None, "compile": ""}
    # the benchmark gets the time the (here instant) tests did not use
    assert limits[-1] == gpu_check.BENCHMARK_LIMIT_S + gpu_check.TESTS_LIMIT_S
    assert "gpu-check: 2/2 tests passed, smoke runs skipped, benchmark done" in \
        capsys.readouterr().out


def fake_gpu_run(monkeypatch, gpus: int, smoke_status: int = 0) -> list:
    """main() on a faked machine with `gpus` GPUs: every part succeeds instantly (a smoke run
    logs its last iteration and exits `smoke_status`); returns the commands run."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: gpus)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *_: "a GPU")
    runs = []

    def run_limited(command, limit_s, **options):
        runs.append(command)
        junit = next((c.split("=", 1)[1] for c in command if c.startswith("--junitxml=")), None)
        if junit:
            Path(junit).write_text('<testsuites><testsuite><testcase classname="tests.x" '
                                   'name="test_it" time="1"/></testsuite></testsuites>')
        if "pretrain_gpt.py" in command:
            return smoke_status, " iteration        4/       4 | lm loss: 4.1\n", "Boom: bad\n"
        return 0, "", ""
    monkeypatch.setattr(gpu_check, "run_limited", run_limited)
    return runs


def test_without_pytest_the_tests_are_skipped_in_one_line(capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytest" else find_spec(name, *a))
    runs = fake_gpu_run(monkeypatch, gpus=1)
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("test")] == [
        "test SKIP tests/gpu, tests/models/test_compile.py: pytest is not installed"]
    assert "gpu-check: tests skipped (no pytest), smoke runs skipped, benchmark done" in out
    assert not any("pytest" in command for command in runs)  # the benchmark still ran
    assert any("benchmarks/gpu_throughput.py" in command for command in runs)


def test_on_one_gpu_the_smoke_runs_are_skipped_in_one_line(capsys, monkeypatch):
    runs = fake_gpu_run(monkeypatch, gpus=1)
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("smoke")] == [
        "smoke SKIP the 2-process NCCL runs (2BW p=2, Flush p=2, t=2 sequence parallel) need 2 "
        "GPUs, 1 visible"]
    assert not any("pretrain_gpt.py" in command for command in runs)


@pytest.mark.parametrize("status, passed", [(0, True), (1, False)])
def test_on_two_gpus_each_smoke_run_reports_one_line(capsys, monkeypatch, status, passed):
    runs = fake_gpu_run(monkeypatch, gpus=2, smoke_status=status)
    assert gpu_check.main() == (0 if passed else 1)
    out = capsys.readouterr().out
    smoke = [line for line in out.splitlines() if line.startswith("smoke")]
    if passed:
        assert [line.rsplit(" (", 1)[0] for line in smoke] == [
            "smoke PASS 2BW p=2", "smoke PASS Flush p=2", "smoke PASS t=2 sequence parallel"]
        assert "3/3 smoke runs passed" in out
    else:
        assert smoke[0] == "smoke FAIL 2BW p=2 (exit 1): Boom: bad" and len(smoke) == 3
        assert "0/3 smoke runs passed" in out and "2BW p=2:\n iteration" in out  # its output
    assert [c for c in runs if "pretrain_gpt.py" in c] == [c for _, c in gpu_check.smoke_commands()]


def test_the_smoke_commands_launch_two_nccl_ranks_of_each_layout():
    commands = dict(gpu_check.smoke_commands())
    layouts = {}
    for name, command in commands.items():
        launcher = command[:command.index("pretrain_gpt.py")]
        assert launcher == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2"]
        flags = command[command.index("pretrain_gpt.py") + 1:]
        config = parse_config(flags)[0]
        p = config.parallel
        layouts[name] = (p.tensor_parallel * p.pipeline_parallel, p.tensor_parallel,
                         p.pipeline_parallel, p.pipeline_schedule, config.model.sequence_parallel,
                         p.distributed_backend, config.training.train_iters)
    assert layouts == {"2BW p=2": (2, 1, 2, "2bw", False, "nccl", 4),
                       "Flush p=2": (2, 1, 2, "flush", False, "nccl", 4),
                       "t=2 sequence parallel": (2, 2, 1, "flush", True, "nccl", 4)}


def test_a_smoke_run_passes_on_gloo(monkeypatch):
    """The 2BW command as built, launched for real with gloo in place of NCCL: it trains and
    gpu-check's pass test recognises its log."""
    monkeypatch.setattr(gpu_check, "SMOKE_RUNS", gpu_check.SMOKE_RUNS[:1])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    lines, ok, failed = gpu_check.run_smoke(env, backend="gloo")
    assert ok and len(lines) == 1 and lines[0].startswith("smoke PASS 2BW p=2 ("), failed
