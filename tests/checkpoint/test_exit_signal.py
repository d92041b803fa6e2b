"""--exit-signal-handler: SIGTERM to a running torchrun job (as Slurm sends on preemption) makes the
workers finish the iteration, save a checkpoint and exit without error. Ctrl-C (SIGINT to the whole
job) does the same at the next drain point; a second Ctrl-C aborts at once."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_2bw.checkpoint.save_load import read_marker, read_metadata
from megatron_2bw.training.exit_request import SAME_INTERRUPT_S
from tests.checkpoint.helpers import pretrain_flags

REPO = Path(__file__).resolve().parents[2]
ITERATION = re.compile(r"iteration\s+(\d+)/")


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    log = tmp_path / "log.txt"
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
               str(REPO / "pretrain_gpt.py"),
               *pretrain_flags(1, 2, 100_000, "--save", str(tmp_path / "ckpt"),
                               "--exit-signal-handler", "--global-batch-size", "4")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}
    with open(log, "w") as output:
        job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ITERATION.search(log.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)  # torchrun passes it on to the workers
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    output = log.read_text()
    saved = read_marker(str(tmp_path / "ckpt"))
    assert saved is not None and saved >= 1, output[-3000:]
    assert f"saved checkpoint at iteration {saved}" in output
    assert f"exiting at iteration {saved}" in output
    assert "FAILED" not in output and "ChildFailedError" not in output, output[-3000:]
    assert read_metadata(str(tmp_path / "ckpt"))["layout"]["pipeline"] == 2
    assert max(int(i) for i in ITERATION.findall(output)) == saved  # stopped right after saving


def _start(tmp_path, *extra):
    log = tmp_path / "log.txt"
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
               "--nproc-per-node", "2", str(REPO / "pretrain_gpt.py"),
               *pretrain_flags(1, 2, 100_000, "--global-batch-size", "4", *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}
    with open(log, "w") as output:
        job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    return job, log


def _wait_for(job, log, pattern: str) -> None:
    deadline = time.monotonic() + 180  # bounds a broken job, not a slow one
    while not re.search(pattern, log.read_text()):
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _ctrl_c(job) -> None:
    """What a terminal does: SIGINT to every process of the foreground job (torchrun and its
    workers; torchrun then forwards its own to the workers as well)."""
    os.killpg(job.pid, signal.SIGINT)


def _worker_tracebacks(output: str) -> int:
    """Tracebacks other than torchrun's own: the launcher reports the signal it got as a
    SignalException with a traceback of its own process, whatever the workers do."""
    return output.count("Traceback") - output.count("elastic.multiprocessing.api.SignalException:")


def _finish(job, timeout: float = 180) -> None:
    try:
        job.wait(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def test_ctrl_c_saves_at_the_next_drain_and_exits_with_one_line(tmp_path):
    job, log = _start(tmp_path, "--save", str(tmp_path / "ckpt"), "--save-interval", "3")
    _wait_for(job, log, r"iteration\s+1/")
    _ctrl_c(job)
    _finish(job)
    output = log.read_text()
    saved = read_marker(str(tmp_path / "ckpt"))
    assert saved is not None and saved % 3 == 0, output[-3000:]
    assert output.count("interrupted (Ctrl-C): stopping at iteration") == 1, output[-3000:]
    assert f"exiting at iteration {saved}" in output
    assert _worker_tracebacks(output) == 0 and "FAILED" not in output, output[-3000:]
    assert "KeyboardInterrupt" not in output
    assert max(int(i) for i in ITERATION.findall(output)) == saved  # stopped at that drain


def test_a_second_ctrl_c_aborts_at_once_without_a_checkpoint(tmp_path):
    job, log = _start(tmp_path, "--save", str(tmp_path / "ckpt"))  # the next drain: far away
    _wait_for(job, log, r"iteration\s+1/")
    _ctrl_c(job)
    _wait_for(job, log, r"interrupted \(Ctrl-C\)")
    time.sleep(SAME_INTERRUPT_S + 0.5)  # a second press, not the first one forwarded
    _ctrl_c(job)
    _finish(job)
    output = log.read_text()
    assert output.count("interrupted again: aborting without a checkpoint") == 1, output[-3000:]
    assert read_marker(str(tmp_path / "ckpt")) is None
    assert _worker_tracebacks(output) == 0 and "KeyboardInterrupt" not in output, output[-3000:]
