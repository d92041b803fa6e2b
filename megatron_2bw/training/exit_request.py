"""Stopping cleanly: SIGTERM (with --exit-signal-handler), Ctrl-C or --exit-duration-in-mins ask
every rank to save and stop at the next drain."""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_2bw.config import Config

# the terminal's Ctrl-C reaches every process of the job and torchrun forwards its own to the
# workers: interrupts this close together are one Ctrl-C
SAME_INTERRUPT_S = 2.0


class ExitRequest:
    """SIGTERM (with --exit-signal-handler), Ctrl-C (SIGINT) or the time limit: save and stop at
    the next drain. A second Ctrl-C aborts at once, without a checkpoint."""

    def __init__(self, config: Config, start_time: float, announce: bool = False,
                 clock=time.monotonic):
        self.signalled = False
        self.deadline = None
        self.announce = announce  # this rank prints the one line an interrupt gets
        self.next_drain: int | None = None  # the iteration of the next drain (set by the loop)
        self.interrupted_at: float | None = None
        self._clock = clock
        if config.training.exit_duration_in_mins:
            self.deadline = start_time + 60 * config.training.exit_duration_in_mins
        # restored when training ends (pretrain() called from a program or a test keeps its own)
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        if config.training.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._handler)
        signal.signal(signal.SIGINT, self._interrupt)

    def __enter__(self) -> "ExitRequest":
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame):
        self.signalled = True

    def _say(self, text: str) -> None:
        if self.announce:  # os.write: print() may be mid-write when the signal arrives
            os.write(sys.stderr.fileno(), f"{text}\n".encode())

    def _interrupt(self, signum, frame):
        now = self._clock()
        if self.interrupted_at is None:
            self.interrupted_at, self.signalled = now, True
            where = f"iteration {self.next_drain}" if self.next_drain else "the next drain"
            self._say(f" interrupted (Ctrl-C): stopping at {where} (the next drain point), after "
                      f"saving a checkpoint where --save is set; Ctrl-C again to abort at once")
            # torchrun answers a second Ctrl-C of its own with SIGTERM to the workers
            signal.signal(signal.SIGTERM, self._abort)
        elif now - self.interrupted_at > SAME_INTERRUPT_S:
            self._abort(signum, frame)

    def _abort(self, signum, frame):
        self._say(" interrupted again: aborting without a checkpoint")
        sys.stdout.flush()
        os._exit(INTERRUPTED_EXIT_CODE)

    def agreed(self, device) -> bool:
        """Collective: every rank learns whether any rank wants to stop."""
        wanted = self.signalled or (self.deadline is not None and time.time() > self.deadline)
        flag = torch.tensor([1.0 if wanted else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
