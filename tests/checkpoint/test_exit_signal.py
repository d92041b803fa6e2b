"""--exit-signal-handler: SIGTERM to a running torchrun job (as Slurm sends on preemption) makes the
workers finish the iteration, save a checkpoint and exit without error."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_2bw.checkpoint.save_load import read_marker, read_metadata
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
