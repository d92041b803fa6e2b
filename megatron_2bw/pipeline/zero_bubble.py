"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The backward of a microbatch is split into B, the gradient with respect to the stage's input
(what the previous stage waits for), and W, the gradients of the stage's weights (what nobody
waits for until the batch's reduce). Sending B's result on at once shortens the chain of
backwards that crosses the pipeline; the W passes, deferred, fill the idle slots of the drain.

ZB-H1 (the ordering torch.distributed.pipelining's ScheduleInterleavedZeroBubble uses with one
chunk per rank): stage r runs 1F1B's p - r - 1 warm-up forwards, then per microbatch i one forward,
the backward B of microbatch i and, from i >= r on, the W of the oldest microbatch whose W is
pending; the r W passes still pending after the last B end the batch. A microbatch's activations
live from its forward to its W, so every stage holds at most p microbatches: 1F1B's peak (its
first stage's). The schedule is vanilla: drained after every batch, batch b uses version b.
"""
from __future__ import annotations

from typing import Iterator

from megatron_2bw.pipeline.actions import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action,
                                           flushed_batches)


def zb_h1_order(stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """(kind, j) of one batch on `stage`: j is the microbatch's index in the batch."""
    m = microbatches
    warmup = min(stages - stage - 1, m)
    order = [(FORWARD, j) for j in range(warmup)]
    pending_w = 0
    for i in range(m):
        if warmup + i < m:
            order.append((FORWARD, warmup + i))
        order.append((BACKWARD_INPUT, i))
        if i >= stage:
            order.append((BACKWARD_WEIGHT, pending_w))
            pending_w += 1
    order += [(BACKWARD_WEIGHT, j) for j in range(pending_w, m)]
    return order


def zb_h1_actions(stages: int, microbatches: int, batches: int, stage: int, first_batch: int,
                  chunks: int = 1) -> Iterator[Action]:
    order = [(kind, 0, j) for kind, j in zb_h1_order(stages, microbatches, stage)]
    yield from flushed_batches(order, stages, stage, 1, microbatches, batches, first_batch)
