"""The global batch size of every iteration: --global-batch-size throughout, or one of
Megatron-LM's two schedules, both functions of the samples consumed before the iteration:

- --rampup-batch-size START INCREMENT SAMPLES (its older flag, in the GPT-3 175B script) grows the
  batch from START by INCREMENT in equal shares of the first SAMPLES samples: START + INCREMENT *
  int(c / (SAMPLES / increments)), at most --global-batch-size, where increments = (global -
  START) / INCREMENT. --train-samples then counts the ramp's iterations one by one and the rest
  in whole global batches (its `update_train_iters`), kept exactly. Megatron-LM refuses the ramp
  with --train-iters, which its own GPT-3 175B script combines with it; here the run is then
  --train-iters iterations, the first ones smaller, the schedules still counted in samples.
- --step-batch-size-schedule "0:768 250B:1536 ..." (its newer flag, which replaced the ramp):
  THRESHOLD:BATCH pairs, thresholds in tokens (K, M, B, T suffixes), converted to samples by the
  sequence length; the batch is the one of the last threshold reached. --train-samples counts
  whole batches.

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
    def __init__(self, global_batch_size: int, rampup: tuple[int, int, int] | None = None,
                 steps: tuple[tuple[int, int], ...] | None = None):
        """`steps`: (threshold in samples, batch) pairs, thresholds from 0 increasing."""
        self.final, self.rampup, self.steps = global_batch_size, rampup, steps
        iteration, consumed, batch = 0, 0, self.batch_after(0)
        self.phases = [Phase(0, 0, batch)]
        while (nxt := self._next_change(consumed)) is not None:
            if self.rampup is not None:  # iteration by iteration: Megatron's float rule decides
                consumed, iteration = consumed + batch, iteration + 1
            else:  # the iterations until the next threshold is reached, at once
                count = -(-(nxt - consumed) // batch)
                consumed, iteration = consumed + count * batch, iteration + count
            if self.batch_after(consumed) != batch:
                batch = self.batch_after(consumed)
                self.phases.append(Phase(iteration, consumed, batch))
        self._firsts = [phase.first_iteration for phase in self.phases]

    def _next_change(self, consumed: int) -> int | None:
        """Where the batch can next change (None: never again)."""
        if self.steps is not None:
            return next((threshold for threshold, _ in self.steps if threshold > consumed), None)
        if self.rampup is not None and self.batch_after(consumed) < self.final:
            return consumed + 1
        return None

    def batch_after(self, consumed_samples: int) -> int:
        """The global batch of an iteration that starts after `consumed_samples` samples."""
        if self.steps is not None:
            return [batch for threshold, batch in self.steps if threshold <= consumed_samples][-1]
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
        """The iterations of --train-samples: whole batches; under --rampup-batch-size Megatron-LM's
        count, the ramp's iterations while at most SAMPLES are consumed, then whole global batches
        of the rest (negative when the ramp passed train_samples: floor division, as Megatron)."""
        if self.rampup is not None:
            iterations, consumed = 0, 0
            while consumed <= self.rampup[2]:
                consumed += self.batch_after(consumed)
                iterations += 1
            return iterations + (train_samples - consumed) // self.final
        phase = self.phases[bisect.bisect_right([p.consumed_before for p in self.phases],
                                                train_samples) - 1]
        return phase.first_iteration + (train_samples - phase.consumed_before) // \
            phase.global_batch_size


def parse_step_schedule(text: str, seq_length: int) -> list[list[int]]:
    """Megatron-LM's "THRESHOLD:BATCH ..." (commas also separate) as [threshold in samples, batch]
    pairs: thresholds in tokens with K, M, B, T suffixes, divided by the sequence length. Raises
    ValueError naming the entry: a malformed one, a first threshold other than 0, thresholds not
    increasing, a batch that is not positive."""
    def number(value: str, entry: str) -> int:
        scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}.get(value[-1:].upper(), 1)
        try:
            return int(float(value[:-1] if scale > 1 else value) * scale)
        except ValueError:
            raise ValueError(f"{entry!r}: {value!r} is not a number") from None

    pairs = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"{entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch = entry.split(":", 1)
        pairs.append([number(threshold, entry) // seq_length, number(batch, entry)])
    if not pairs or pairs[0][0] != 0:
        raise ValueError("the first entry must have threshold 0")
    for (before, _), (after, _) in zip(pairs, pairs[1:]):
        if after <= before:
            raise ValueError(f"thresholds must increase (in samples of {seq_length} tokens: "
                             f"{before} then {after})")
    if any(batch <= 0 for _, batch in pairs):
        raise ValueError("every batch size must be positive")
    return pairs


@functools.lru_cache(maxsize=8)
def _schedule(global_batch_size: int, rampup: tuple[int, int, int] | None,
              steps: tuple[tuple[int, int], ...] | None) -> BatchSchedule:
    return BatchSchedule(global_batch_size, rampup, steps)


def batch_schedule(train: TrainingConfig) -> BatchSchedule:
    """The schedule of `train` (cached: the lr schedule asks for it every step)."""
    rampup = tuple(train.rampup_batch_size) if train.rampup_batch_size else None
    steps = tuple(map(tuple, train.step_batch_size_schedule)) \
        if train.step_batch_size_schedule else None
    return _schedule(train.global_batch_size, rampup, steps)
