"""A job owns its --save directory for its whole life, so that two jobs never mix their files.

Global rank 0 takes SAVE/save.lock (created exclusively) before anything is written there, renews
its modification time every HEARTBEAT_SECONDS from a thread, and removes it when the run ends. A
second job finds the lock and stops before training, naming the holder. A job that was killed
leaves its lock behind; its successor takes it over, saying so, when it is

- a restart on the same host (the holder's process is gone), or of the same torchrun (the same
  TORCHELASTIC_RUN_ID),
- a Slurm requeue (the same SLURM_JOB_ID), or
- anything else, once the holder stopped renewing it for STALE_SECONDS.

A run that starts fresh (no --load of the directory) into a --save that holds another run's
checkpoints is refused too, unless --overwrite-save says so. Rank 0 decides; every rank learns the
decision by one broadcast and stops (or goes on) together.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

import torch.distributed as dist

from megatron_2bw.checkpoint.save_load import CheckpointError, has_checkpoint, read_marker

LOCK_FILE = "save.lock"
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 600.0  # 20 missed renewals: the holder is gone (or its file system is)


def job_id() -> str | None:
    """What a restarted or requeued job shares with the job it replaces."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm {os.environ['SLURM_JOB_ID']}"
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"torchrun {run}" if run and run != "none" else None


@dataclass
class Holder:
    host: str
    pid: int
    started: str  # UTC, ISO 8601
    job: str | None
    token: str  # this holder's own, to tell its lock from a successor's

    @classmethod
    def me(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(),
                   time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), job_id(), uuid.uuid4().hex)

    def describe(self) -> str:
        job = f", {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}, started {self.started}{job}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _read_holder(path: str) -> Holder | None:
    """The lock's holder; None for a lock that cannot be read (being written, or damaged)."""
    try:
        with open(path) as f:
            return Holder(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def takeover_reason(holder: Holder | None, age: float, me: Holder) -> str | None:
    """Why `me` may take over a lock last renewed `age` seconds ago (None: it may not)."""
    if holder is not None and holder.job is not None and holder.job == me.job:
        return f"the same job ({me.job}) restarted or requeued"
    if holder is not None and holder.host == me.host and (holder.pid == me.pid
                                                          or not _alive(holder.pid)):
        return f"its process {holder.pid} on {holder.host} is gone"
    if age > STALE_SECONDS:
        return f"it was last renewed {age:.0f} s ago (the holder stopped)"
    return None


class SaveLock:
    """The lock of one --save directory, held by this process (global rank 0)."""

    def __init__(self, root: str):
        self.root = root
        self.path = os.path.join(root, LOCK_FILE)
        self.me = Holder.me()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, exclusive: bool) -> None:
        text = json.dumps(asdict(self.me)) + "\n"
        if exclusive:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            return
        tmp = f"{self.path}.{self.me.token}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)

    def acquire(self) -> str | None:
        """Take the lock; returns a line when it took over a killed job's. Raises CheckpointError
        naming the holder when another job holds it."""
        os.makedirs(self.root, exist_ok=True)
        try:
            self._write(exclusive=True)
            return None
        except FileExistsError:
            pass
        holder = _read_holder(self.path)
        try:
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:  # released meanwhile
            return self.acquire()
        reason = takeover_reason(holder, age, self.me)
        if reason is None:
            who = holder.describe() if holder is not None else "an unreadable holder"
            raise CheckpointError(
                f"--save {self.root} is in use by another job ({who}): wait for it to end, or "
                f"save elsewhere; if that job is dead, delete {self.path}")
        self._write(exclusive=False)
        if not self.held():  # another successor replaced it at the same moment: it won
            winner = _read_holder(self.path)
            raise CheckpointError(f"--save {self.root} was just taken over by another job "
                                  f"({winner.describe() if winner else 'unreadable'})")
        previous = holder.describe() if holder is not None else "unreadable"
        return f" --save {self.root}: took over the lock of a job that ended ({previous}): {reason}"

    def start_heartbeat(self) -> None:
        def renew():
            while not self._stop.wait(HEARTBEAT_SECONDS):
                if not self.held():
                    print(f" WARNING: --save {self.root}: another job took over {self.path}",
                          flush=True)
                    return
                try:
                    os.utime(self.path)
                except OSError:
                    pass  # a file system hiccup: the next renewal tries again
        self._thread = threading.Thread(target=renew, name="save-lock-heartbeat", daemon=True)
        self._thread.start()

    def held(self) -> bool:
        holder = _read_holder(self.path)
        return holder is not None and holder.token == self.me.token

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.held():
            os.remove(self.path)


def fresh_run_over_checkpoints(root: str, load: str | None, overwrite: bool) -> str | None:
    """A run not resuming --save's checkpoints would write over them: refused (CheckpointError)
    unless `overwrite`, then a warning line is returned."""
    if not has_checkpoint(root):
        return None
    if load and os.path.isdir(load) and os.path.samefile(load, root):
        return None
    latest = read_marker(root)
    if not overwrite:
        raise CheckpointError(f"--save {root} holds another run's checkpoints (latest iteration "
                              f"{latest}): resume them with --load {root}, save elsewhere, or "
                              f"pass --overwrite-save to write over them")
    return f" WARNING: --overwrite-save: writing over the checkpoints in {root} (latest " \
           f"iteration {latest})"


def claim_save_directory(config, layout, device) -> SaveLock | None:
    """Collective (every rank calls it before the model is built): global rank 0 takes --save's
    lock and checks that the run may write there; every rank raises the same CheckpointError if
    not. Returns rank 0's lock (None on other ranks, and without --save)."""
    ckpt = config.checkpoint
    if not ckpt.save:
        return None
    lock, outcome = None, [None, []]  # [error, lines to print]
    if layout.rank == 0:
        lock = SaveLock(ckpt.save)
        try:
            lines = [lock.acquire()]
            lines.append(fresh_run_over_checkpoints(ckpt.save, ckpt.load, ckpt.overwrite_save))
            outcome = [None, [line for line in lines if line]]
        except (CheckpointError, OSError) as error:  # every rank must learn of it, or they hang
            outcome = [str(error) if isinstance(error, CheckpointError)
                       else f"--save {ckpt.save}: cannot take {lock.path} ({error})", []]
            if lock.held():
                lock.release()
            lock = None
    if dist.is_initialized() and layout.world_size > 1:
        dist.broadcast_object_list(outcome, src=0, device=device)
    error, lines = outcome
    if error is not None:
        raise CheckpointError(error)
    if lock is not None:
        for line in lines:
            print(line, flush=True)
        lock.start_heartbeat()
    return lock
