"""Hang diagnosis and faults: a stalled rank or a killed rank ends the whole job (well before a
hang's default ten-minute timeout, however slow the machine), with a message naming the failing
rank, its stage and schedule action, and no process is left behind."""
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


# a bound on a broken job (a hang waits for the default timeout, 10 minutes), not on a slow one
JOB_ENDS_WITHIN_S = 240


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


def _left_behind(workers) -> list:
    """The workers still running a while after the job ended (torchrun ends them as it exits;
    the wait only absorbs a slow machine)."""
    _, alive = psutil.wait_procs(workers, timeout=30)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_stalled_receive_ends_the_job_naming_rank_stage_and_action():
    job = _launch("tests/functional/stall_rank.py", ["--train-iters", "5"],
                  {"STALL_RANK": "0", "STALL_ACTION": "F2@v0", "PYTHONPATH": ROOT})
    workers = []
    start = time.time()
    try:
        while job.poll() is None and time.time() - start < 20:
            workers = workers or _descendants(job)
            time.sleep(0.2)
        output, _ = job.communicate(timeout=JOB_ENDS_WITHIN_S)
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    assert job.returncode != 0
    assert "FAILED: rank 1 (tp=0/1, dp=0/1, pp=1/2), stage 1" in output, output
    assert "recv_act(2)" in output and "timed out" in output.lower(), output
    assert not _left_behind(workers)


def test_kill_9_of_one_rank_ends_every_rank():
    # a minute's timeout: ranks starting at different speeds on a loaded machine still meet;
    # torchrun ends the job once a worker dies, whatever the timeout
    job = _launch(os.path.join(ROOT, "pretrain_gpt.py"), ["--train-iters", "100000",
                                                          "--distributed-timeout-minutes", "1"])
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
        output, _ = job.communicate(timeout=JOB_ENDS_WITHIN_S)
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    output = "".join(lines) + output
    assert job.returncode != 0
    assert "Signals.SIGKILL" in output or "exitcode  : -9" in output or "-9" in output, output
    assert not _left_behind(workers)


def _root_cause(output: str) -> dict[str, str]:
    """The fields of torchrun's "Root Cause (first observed failure)" block."""
    block = output.split("Root Cause (first observed failure):")[1]
    return {key.strip(): value.strip() for key, value in
            (line.split(":", 1) for line in block.splitlines() if " : " in line)}


def test_torchrun_summary_names_the_rank_and_the_one_line_error_last():
    """A bad input under torchrun: the ranks' one line (exit code 2) is the root cause torchrun's
    summary names, the last thing it prints; no "To enable traceback" placeholder."""
    job = _launch(os.path.join(ROOT, "pretrain_gpt.py"), ["--train-iters", "2",
                                                          "--save", "/proc/version/ckpt"])
    output, _ = job.communicate(timeout=JOB_ENDS_WITHIN_S)
    assert job.returncode != 0
    cause = _root_cause(output)
    assert cause["exitcode"].startswith("2 "), output
    assert cause["traceback"].startswith("pretrain_gpt.py: error: --save /proc/version/ckpt"), \
        output
    assert "To enable traceback" not in output
    last = [line for line in output.splitlines() if line.strip() and set(line.strip()) != {"="}]
    assert last[-1].strip().startswith("traceback : pretrain_gpt.py: error: --save"), output


def test_torchrun_summary_names_the_rank_of_a_runtime_failure():
    job = _launch("tests/functional/stall_rank.py", ["--train-iters", "5"],
                  {"STALL_RANK": "0", "STALL_ACTION": "F2@v0", "PYTHONPATH": ROOT})
    try:
        output, _ = job.communicate(timeout=JOB_ENDS_WITHIN_S)
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    cause = _root_cause(output)
    assert cause["rank"].startswith("1 "), output
    assert cause["traceback"].startswith("FAILED: rank 1 (tp=0/1, dp=0/1, pp=1/2), stage 1: "), \
        output
    assert "To enable traceback" not in output
