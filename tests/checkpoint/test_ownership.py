"""A job owns its --save directory: a second job stops before training naming the holder, a killed
job's successor takes over saying so, every rank stops together; a fresh run does not write over
another run's checkpoints unless --overwrite-save says so."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_2bw.arguments import parse_config
from megatron_2bw.checkpoint import ownership
from megatron_2bw.checkpoint.ownership import LOCK_FILE, STALE_SECONDS, Holder, SaveLock
from megatron_2bw.checkpoint.save_load import CheckpointError
from megatron_2bw.training.loop import pretrain
from tests.distributed_helpers import run_ranks
from tests.training.runs import ROOT

FLAGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
         "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "2", "--lr", "1e-3", "--lr-decay-iters", "10", "--mock-data",
         "--vocab-size", "64", "--eval-iters", "0", "--distributed-timeout-minutes", "1"]


@pytest.fixture
def other_process():
    """A live process of this host that is not this test's."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process.pid
    process.kill()
    process.wait()


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _write_lock(root, host: str, pid: int, job: str | None = None, age: float = 0.0):
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK_FILE)
    with open(path, "w") as f:
        json.dump({"host": host, "pid": pid, "started": "2026-12-01T10:00:00Z", "job": job,
                   "token": "theirs"}, f)
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


def _pretrain(*flags):
    return subprocess.run([sys.executable, "pretrain_gpt.py", *FLAGS, *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(autouse=True)
def no_job_ids(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def test_a_second_job_stops_before_training_with_one_line_naming_the_holder(tmp_path,
                                                                             other_process):
    host = socket.gethostname()
    _write_lock(tmp_path, host, other_process)
    result = _pretrain("--save", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr == (f"pretrain_gpt.py: error: --save {tmp_path} is in use by another job "
                             f"(host {host}, pid {other_process}, started 2026-12-01T10:00:00Z): "
                             f"wait for it to end, or save elsewhere; if that job is dead, delete "
                             f"{tmp_path / LOCK_FILE}\n")
    assert "iteration" not in result.stdout and sorted(os.listdir(tmp_path)) == [LOCK_FILE]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs"  # left alone


def _pretrain_reporting(rank, world, flags):
    try:
        pretrain(parse_config(flags)[0])
    except CheckpointError as error:
        return str(error)
    return None


def test_every_rank_stops_together_on_rank_0s_decision(tmp_path, other_process):
    _write_lock(tmp_path, socket.gethostname(), other_process)
    errors = run_ranks(2, _pretrain_reporting, [*FLAGS, "--global-batch-size", "4", "--save",
                                                str(tmp_path)], timeout=120)
    assert errors[0] is not None and errors[0].startswith(f"--save {tmp_path} is in use")
    assert errors[1] == errors[0]


def test_a_finished_run_releases_the_lock_and_a_killed_ones_successor_takes_over(tmp_path):
    result = _pretrain("--save", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / LOCK_FILE).exists()
    _write_lock(tmp_path, socket.gethostname(), _dead_pid())  # killed: its lock stayed
    result = _pretrain("--save", str(tmp_path), "--load", str(tmp_path), "--train-iters", "3")
    assert result.returncode == 0, result.stderr
    took_over = [line for line in result.stdout.splitlines() if "took over" in line]
    assert len(took_over) == 1 and "is gone" in took_over[0], result.stdout
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_requeue_or_a_holder_that_stopped_renewing_is_taken_over(tmp_path, monkeypatch,
                                                                   other_process):
    path = _write_lock(tmp_path, "elsewhere", 4242, job="slurm 77")
    with pytest.raises(CheckpointError, match="in use by another job .host elsewhere, pid 4242, "
                                              "started 2026-12-01T10:00:00Z, slurm 77"):
        SaveLock(str(tmp_path)).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # the same job, requeued
    lock = SaveLock(str(tmp_path))
    assert "the same job (slurm 77) restarted or requeued" in lock.acquire()
    assert lock.held()
    lock.release()
    assert not os.path.exists(path)
    monkeypatch.delenv("SLURM_JOB_ID")
    _write_lock(tmp_path, "elsewhere", 4242, age=STALE_SECONDS + 5)
    assert "the holder stopped" in SaveLock(str(tmp_path)).acquire()
    _write_lock(tmp_path, socket.gethostname(), other_process, age=STALE_SECONDS - 60)
    with pytest.raises(CheckpointError):  # alive, renewed lately, another job
        SaveLock(str(tmp_path)).acquire()


def test_the_heartbeat_renews_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(ownership, "HEARTBEAT_SECONDS", 0.05)
    lock = SaveLock(str(tmp_path))
    assert lock.acquire() is None
    os.utime(lock.path, (time.time() - 1000, time.time() - 1000))
    lock.start_heartbeat()
    deadline = time.time() + 10
    while time.time() - os.path.getmtime(lock.path) > 100 and time.time() < deadline:
        time.sleep(0.05)
    assert time.time() - os.path.getmtime(lock.path) < 100
    lock.release()
    assert not os.path.exists(lock.path)
    assert Holder(**{**vars(lock.me)}).describe().startswith(f"host {socket.gethostname()}")


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_unless_overwrite_save(tmp_path):
    assert _pretrain("--save", str(tmp_path)).returncode == 0
    refused = _pretrain("--save", str(tmp_path), "--train-iters", "1")
    assert refused.returncode == 2
    assert refused.stderr == (f"pretrain_gpt.py: error: --save {tmp_path} holds another run's "
                              f"checkpoints (latest iteration 2): resume them with --load "
                              f"{tmp_path}, save elsewhere, or pass --overwrite-save to write over "
                              f"them\n")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    overwritten = _pretrain("--save", str(tmp_path), "--train-iters", "1", "--overwrite-save")
    assert overwritten.returncode == 0, overwritten.stderr
    assert f"WARNING: --overwrite-save: writing over the checkpoints in {tmp_path} (latest " \
           f"iteration 2)" in overwritten.stdout
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1\n"
