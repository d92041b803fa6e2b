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
