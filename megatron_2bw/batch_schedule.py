"""The global batch size of every iteration: --global-batch-size throughout, or Megatron-LM's
--rampup-batch-size START INCREMENT SAMPLES, which grows it from START by INCREMENT in equal
shares of the first SAMPLES samples.

Megatron-LM's rule, kept exactly: an iteration that starts after c consumed samples has the batch
START + INCREMENT * int(c / (SAMPLES / increments)), at most --global-batch-size, where increments
= (global - START) / INCREMENT. --train-samples then counts the ramp's iterations one by one and
the rest in whole global batches (its `update_train_iters`).

The pipeline runs a fixed number of microbatches per batch, so the training loop drains it where
the batch size changes (training.segment_ends): under 2BW the ramp's few changes cost one fill and
drain each, like an evaluation."""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from megatron_2bw.config import TrainingConfig


@dataclass(frozen=True)
class Phase:
    first_iteration: int
    consumed_before: int  # samples consumed by the iterations before it
    global_batch_size: int


class BatchSchedule:
    def __init__(self, global_batch_size: int, rampup: tuple[int, int, int] | None):
        self.final = global_batch_size
        self.rampup = rampup
        iteration, consumed, batch = 0, 0, self.batch_after(0)
        self.phases = [Phase(0, 0, batch)]
        # the ramp iteration by iteration: Megatron-LM's float rule decides where the batch grows
        while rampup is not None and batch < global_batch_size:
            consumed += batch
            iteration += 1
            if self.batch_after(consumed) != batch:
                batch = self.batch_after(consumed)
                self.phases.append(Phase(iteration, consumed, batch))
        self._firsts = [phase.first_iteration for phase in self.phases]

    def batch_after(self, consumed_samples: int) -> int:
        """The global batch of an iteration that starts after `consumed_samples` samples."""
        if self.rampup is None:
            return self.final
        start, increment, samples = self.rampup
        increments = (self.final - start) // increment
        if increments == 0 or consumed_samples > samples:
            return self.final
        return min(self.final, start + increment * int(consumed_samples / (samples / increments)))

    def _phase(self, iteration: int) -> Phase:
        return self.phases[bisect.bisect_right(self._firsts, iteration) - 1]

    def global_batch(self, iteration: int) -> int:
        """The global batch size of iteration `iteration` (0-based)."""
        return self._phase(iteration).global_batch_size

    def consumed(self, iterations: int) -> int:
        """Samples consumed by the first `iterations` iterations."""
        phase = self._phase(iterations)
        return phase.consumed_before + (iterations - phase.first_iteration) * phase.global_batch_size

    def changes(self) -> list[int]:
        """The iterations whose batch size differs from the one before."""
        return self._firsts[1:]

    def iterations_for_samples(self, train_samples: int) -> int:
        """Megatron-LM's --train-samples count: the ramp's iterations while at most `samples` (and
        at most train_samples) are consumed, then whole global batches of the rest."""
        ramp_samples = self.rampup[2] if self.rampup is not None else -1
        iterations, consumed = 0, 0
        while consumed <= ramp_samples and consumed <= train_samples:
            consumed += self.batch_after(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.final
        return iterations


@functools.lru_cache(maxsize=8)
def _schedule(global_batch_size: int, rampup: tuple[int, int, int] | None) -> BatchSchedule:
    return BatchSchedule(global_batch_size, rampup)


def batch_schedule(train: TrainingConfig) -> BatchSchedule:
    """The schedule of `train` (cached: the lr schedule asks for it every step)."""
    rampup = tuple(train.rampup_batch_size) if train.rampup_batch_size else None
    return _schedule(train.global_batch_size, rampup)
