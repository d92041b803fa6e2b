"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 6).

Two model chunks per rank in a V (placement.py): chunk 0 runs down the ranks, chunk 1 back up, so
the first and last virtual stages share rank 0 and the turn on the last rank needs no transfer.
The backward is split into B (input gradient) and W (weight gradient), as in ZB-H1. Rank r of p
runs, per batch of m microbatches (F0/F1, B0/B1, W0/W1: the pass on chunk 0/1):
- warm-up: 2(p-r)-1 F0; then r pairs (F1, F0); then p-r triples (F1, B1, W1);
- steady state: (F0 while any is left, B0, W0, F1, B1, W1) until every forward has run;
- cool-down: r pairs (B0, B1) whose W wait; p-r pairs (B0, the oldest waiting W0); then the
  waiting W1s and W0s.
With F = B = W per chunk the bubble vanishes; a rank holds at most 2p microbatch-chunks (half a
stage each): 1F1B's peak activation memory. Below m = 2p - 1 microbatches the order is built for
2p - 1 and the passes of the missing microbatches are left out. Vanilla: drained per batch.
"""
from __future__ import annotations

from typing import Iterator

from megatron_2bw.pipeline.actions import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action,
                                           aligned_flushed_batches)

F, B, W = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT


def zb_v_order(stages: int, microbatches: int, stage: int) -> list[tuple[str, int, int]]:
    """(kind, chunk, j) of one batch on `stage` (j: the microbatch's index in the batch)."""
    p, r = stages, stage
    total = max(2 * p - 1, microbatches)
    order: list[tuple[str, int, int]] = []
    count = {(kind, chunk): 0 for kind in (F, B, W) for chunk in (0, 1)}

    def run(kind: str, chunk: int, j: int | None = None) -> None:
        if j is None:
            j = count[(kind, chunk)]
            count[(kind, chunk)] += 1
        order.append((kind, chunk, j))

    for _ in range(2 * (p - r) - 1):
        run(F, 0)
    for _ in range(r):
        run(F, 1)
        run(F, 0)
    for _ in range(p - r):
        run(F, 1), run(B, 1), run(W, 1)
    while count[(F, 1)] < count[(F, 0)] or count[(F, 0)] < total:
        if count[(F, 0)] < total:
            run(F, 0)
        run(B, 0), run(W, 0), run(F, 1), run(B, 1), run(W, 1)
    for _ in range(r):
        run(B, 0), run(B, 1)
    for _ in range(p - r):
        run(B, 0), run(W, 0)
    for chunk in (1, 0):
        while count[(W, chunk)] < count[(B, chunk)]:
            run(W, chunk)
    return [(kind, chunk, j) for kind, chunk, j in order if j < microbatches]


def zb_v_actions(stages: int, microbatches: int, batches: int, stage: int, first_batch: int = 0,
                 chunks: int = 2) -> Iterator[Action]:
    def order(s: int) -> list[tuple[str, int, int]]:
        return zb_v_order(stages, microbatches, s)
    yield from aligned_flushed_batches(order, stages, stage, 2, microbatches, batches, first_batch,
                                       shape="v")
