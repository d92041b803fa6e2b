"""1F1B generators: PipeDream-Flush, and the never-drained schedules that share its order
(PipeDream-2BW, PipeDream with and without vertical sync, PipeMare).

Stage r runs p-r-1 warm-up forwards, then alternates one forward and one backward, then drains.
- "flush": one such sequence per batch, drained after it; batch b uses version b.
- "2bw", "pipedream", "pipedream-vs": one sequence over every microbatch of a segment, never
  drained; batch b uses version_rules.version_for_batch. After its last backward of batch b a stage
  reduces the batch's gradients; the step that creates version b+1 is deferred until that version
  is first needed (first forward of a batch that reads it) or the gradient buffer is needed again
  (reduce of batch b+1), so cross-stage decisions (global grad norm, fp16 overflow) complete in
  the background. In the segment's final drain, where those forwards are missing, the step keeps
  the slot the forward would have had, so the stages' steps stay in their steady-state order.
- "pipemare": the same never-drained order with ONE version per stage, stepped right after each
  batch's reduction; forwards read pipemare.forward_version, backwards the newest version.
"""
from __future__ import annotations

from functools import partial
from typing import Iterator

from megatron_2bw.pipeline import pipemare
from megatron_2bw.pipeline.actions import (BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, REDUCE_GRADS,
                                           RELEASE_VERSION, SEND_ACT, SEND_GRAD, STEP, Action,
                                           end_of_flushed_batch)
from megatron_2bw.pipeline.version_rules import version_for_batch

NEVER_DRAINED = ("2bw", "pipedream", "pipedream-vs", "pipemare")


def one_f_one_b_actions(schedule: str, stages: int, microbatches: int, batches: int, stage: int,
                        first_batch: int = 0, chunks: int = 1) -> Iterator[Action]:
    first, last = stage == 0, stage == stages - 1
    m = microbatches
    pending_steps: list[int] = []  # never-drained schedules: batches whose step is deferred
    never_drained = schedule in NEVER_DRAINED
    deferred = never_drained and schedule != "pipemare"

    def version_of_batch(b: int) -> int:
        return version_for_batch(schedule, b, stage, stages)

    def version(k: int) -> int:
        return version_of_batch(k // m)

    def forward_version(k: int) -> int:
        if schedule == "pipemare":
            return pipemare.forward_version(k, m, stage, stages, first_batch)
        return version(k)

    def flush_pending_steps():
        while pending_steps:
            b = pending_steps.pop(0)
            yield Action(STEP, version=b + 1, batch=b)

    def steps_due_before_forward(k: int):
        if deferred and pending_steps and version(k) > pending_steps[0]:
            yield from flush_pending_steps()

    def forward(k: int):
        yield from steps_due_before_forward(k)
        if not first:
            yield Action(RECV_ACT, k)
        yield Action(FORWARD, k, forward_version(k))
        if not last:
            yield Action(SEND_ACT, k)

    def backward(k: int):
        if not last:
            yield Action(RECV_GRAD, k)
        yield Action(BACKWARD, k, version(k))
        if not first:
            yield Action(SEND_GRAD, k)
        if k % m == m - 1:  # the batch's last backward on this stage
            yield from end_of_batch(k // m)

    def end_of_batch(b: int):
        if not deferred:
            yield from end_of_flushed_batch(b)
            return
        v = version_of_batch(b)
        if version_of_batch(b + 1) != v:
            yield Action(RELEASE_VERSION, version=v)
        yield from flush_pending_steps()  # reduce_grads(b) needs the gradient buffer
        yield Action(REDUCE_GRADS, batch=b)
        pending_steps.append(b)

    def sequence(ks: list[int]):
        warmup = min(stages - stage - 1, len(ks))
        for k in ks[:warmup]:
            yield from forward(k)
        for i, k in enumerate(ks[warmup:]):
            yield from forward(k)
            yield from backward(ks[i])
        for k in ks[len(ks) - warmup:]:  # the drain: backward k where forward k+warmup would be
            yield from steps_due_before_forward(k + warmup)
            yield from backward(k)

    if never_drained:
        yield from sequence(list(range(first_batch * m, (first_batch + batches) * m)))
        yield from flush_pending_steps()
    else:
        for b in range(first_batch, first_batch + batches):
            yield from sequence(list(range(b * m, (b + 1) * m)))


flush_actions = partial(one_f_one_b_actions, "flush")
two_bw_actions = partial(one_f_one_b_actions, "2bw")
pipedream_actions = partial(one_f_one_b_actions, "pipedream")
pipedream_vs_actions = partial(one_f_one_b_actions, "pipedream-vs")
pipemare_actions = partial(one_f_one_b_actions, "pipemare")
