"""Hang diagnosis and faults: a stalled rank or a killed rank ends the whole job within the
distributed timeout, with a message naming the failing rank, its stage and schedule action, and no
process is left behind."""
import os
import signal
import subprocess
import sys
import time

import psutil

from tests.distributed_helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size",
        "64", "--pipeline-model-parallel-size", "2", "--log-interval", "1", "--lr", "1e-3",
        "--distributed-timeout-minutes", "0.1"]  # 6 s


def _launch(script, extra, env=None):
    command = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), script,
               *TINY, *extra]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **(env or {})}, start_new_session=True)


def _descendants(process):
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_a_stalled_receive_ends_the_job_naming_rank_stage_and_action():
    job = _launch("tests/functional/stall_rank.py", ["--train-iters", "5"],
                  {"STALL_RANK": "0", "STALL_ACTION": "F2@v0", "PYTHONPATH": ROOT})
    workers = []
    start = time.time()
    try:
        while job.poll() is None and time.time() - start < 20:
            workers = workers or _descendants(job)
            time.sleep(0.2)
        output, _ = job.communicate(timeout=90)
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    elapsed = time.time() - start
    assert job.returncode != 0
    assert "FAILED: rank 1 (tp=0/1, dp=0/1, pp=1/2), stage 1" in output, output
    assert "recv_act(2)" in output and "timed out" in output.lower(), output
    assert elapsed < 60, elapsed
    time.sleep(1)
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_kill_9_of_one_rank_ends_every_rank():
    job = _launch(os.path.join(ROOT, "pretrain_gpt.py"), ["--train-iters", "100000"])
    start = time.time()
    lines = []
    try:
        for line in job.stdout:  # wait until training runs
            lines.append(line)
            if "iteration" in line and "lm loss" in line:
                break
        workers = [p for p in _descendants(job) if "pretrain_gpt.py" in " ".join(p.cmdline())]
        assert len(workers) == 2
        victim = workers[0]
        victim.send_signal(signal.SIGKILL)
        killed_at = time.time()
        output, _ = job.communicate(timeout=90)
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    output = "".join(lines) + output
    assert job.returncode != 0
    assert time.time() - killed_at < 45
    assert "Signals.SIGKILL" in output or "exitcode  : -9" in output or "-9" in output, output
    time.sleep(1)
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert time.time() - start < 120
