"""tools/gpu_check.py on the CPU: without a GPU it says so and exits 0; each of its parts runs
under a time limit, so a hang cannot take a short GPU session."""
import importlib.util
import sys
from pathlib import Path

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
    assert "gpu-check: 2/2 tests passed, benchmark done" in capsys.readouterr().out
