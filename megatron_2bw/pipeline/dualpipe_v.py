"""DualPipeV (DeepSeek's DualPipe, "cut in half" by Sea AI Lab into a V; deepseek-ai/DualPipe).

Two model chunks per rank in a V (placement.py). Its steady state pairs a forward of one chunk
with a full backward of the other (F&B), which a device can overlap (one's compute with the other's
communication); here the pair runs as two consecutive passes. Rank r of p, per batch of m >= 2p
microbatches (F0/F1: forward of chunk 0/1, B: full backward, I: input-gradient backward whose
weight gradient W waits in a queue):
  1. 2(p-r-1) F0            2. r+1 times F0 F1          3. p-r-1 times I1, a queued W, F1
  4. m-2p+r+1 times F0&B1, F1&B0                        5. p-r-1 times B1, F1&B0
  6. r+1 times B1 B0, turning to I from the middle on (by r's parity, as DualPipe does)
  7. p-r-1 times a queued W, B0 (or I0)                 8. r+1 queued Ws
Bubble (DualPipe's README, PP = 2p stages): (p - 1)(F&B + B - 3W). Vanilla: drained per batch.
"""
from __future__ import annotations

from typing import Iterator

from megatron_2bw.pipeline.actions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                                           Action, aligned_flushed_batches)


def dualpipe_v_order(stages: int, microbatches: int, stage: int) -> list[tuple[str, int, int]]:
    """(kind, chunk, j) of one batch on `stage` (j: the microbatch's index in the batch)."""
    p, r, m = stages, stage, microbatches
    order: list[tuple[str, int, int]] = []
    forwards, backwards = [0, 0], [0, 0]  # per chunk: passes run so far
    waiting: list[tuple[int, int]] = []  # (chunk, j) whose weight gradient is still due

    def forward(chunk: int) -> None:
        order.append((FORWARD, chunk, forwards[chunk]))
        forwards[chunk] += 1

    def backward(chunk: int, split: bool = False) -> None:
        j = backwards[chunk]
        backwards[chunk] += 1
        order.append((BACKWARD_INPUT if split else BACKWARD, chunk, j))
        if split:
            waiting.append((chunk, j))

    def weight() -> None:
        if waiting:
            chunk, j = waiting.pop(0)
            order.append((BACKWARD_WEIGHT, chunk, j))

    for _ in range(2 * (p - r - 1)):
        forward(0)
    for _ in range(r + 1):
        forward(0), forward(1)
    for _ in range(p - r - 1):
        backward(1, split=True), weight(), forward(1)
    for _ in range(m - 2 * p + r + 1):
        forward(0), backward(1), forward(1), backward(0)
    for _ in range(p - r - 1):
        backward(1), forward(1), backward(0)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(p - r - 1):
        weight(), backward(0, split)
    for _ in range(r + 1):
        weight()
    return order


def dualpipe_v_actions(stages: int, microbatches: int, batches: int, stage: int,
                       first_batch: int = 0, chunks: int = 2) -> Iterator[Action]:
    def order(s: int) -> list[tuple[str, int, int]]:
        return dualpipe_v_order(stages, microbatches, s)
    yield from aligned_flushed_batches(order, stages, stage, 2, microbatches, batches, first_batch,
                                       shape="v")
