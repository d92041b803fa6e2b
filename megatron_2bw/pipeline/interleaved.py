"""Megatron-LM's interleaved 1F1B schedule (Narayanan et al., SC 2021).

Each of the p ranks holds v model chunks; chunk c of rank r is virtual stage c * p + r, so a
microbatch visits every rank v times and the pipeline's fill and drain shrink to 1/v of 1F1B's
(bubble (p - 1) / (v m) of the batch time). Megatron's ordering: forward i of a rank is the
chunk (i mod p v) div p of microbatch (i div p v) p + i mod p, i.e. microbatches in groups of p
through each chunk in turn (so m must be a multiple of p); backward i takes the chunks in the
opposite order. Rank r runs (p - r - 1) * 2 + (v - 1) * p warm-up forwards (all of them when
m = p), then alternates one forward and one backward, then drains. Vanilla: drained per batch.
"""
from __future__ import annotations

from typing import Iterator

from megatron_2bw.pipeline.actions import BACKWARD, FORWARD, Action, flushed_batches


def _chunk_and_microbatch(i: int, stages: int, chunks: int, forward: bool) -> tuple[int, int]:
    group, position = divmod(i, stages * chunks)
    chunk = position // stages
    return (chunk if forward else chunks - 1 - chunk), group * stages + position % stages


def forward_order(stages: int, microbatches: int, chunks: int) -> list[tuple[int, int]]:
    """(chunk, microbatch) of every forward of a rank, in order (the same on every rank)."""
    return [_chunk_and_microbatch(i, stages, chunks, True) for i in range(microbatches * chunks)]


def backward_order(stages: int, microbatches: int, chunks: int) -> list[tuple[int, int]]:
    return [_chunk_and_microbatch(i, stages, chunks, False) for i in range(microbatches * chunks)]


def warmup_forwards(stages: int, microbatches: int, stage: int, chunks: int) -> int:
    total = microbatches * chunks
    if microbatches == stages:
        return total
    return min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)


def interleaved_order(stages: int, microbatches: int, stage: int,
                      chunks: int) -> list[tuple[str, int, int]]:
    """(kind, chunk, j) of one batch on `stage`: j is the microbatch's index in the batch."""
    forwards = forward_order(stages, microbatches, chunks)
    backwards = backward_order(stages, microbatches, chunks)
    warmup = warmup_forwards(stages, microbatches, stage, chunks)
    order = [(FORWARD, *forwards[i]) for i in range(warmup)]
    for i in range(len(forwards) - warmup):
        order += [(FORWARD, *forwards[warmup + i]), (BACKWARD, *backwards[i])]
    order += [(BACKWARD, *backwards[i]) for i in range(len(forwards) - warmup, len(forwards))]
    return order


def interleaved_actions(stages: int, microbatches: int, batches: int, stage: int,
                        first_batch: int, chunks: int = 1) -> Iterator[Action]:
    order = interleaved_order(stages, microbatches, stage, chunks)
    yield from flushed_batches(order, stages, stage, chunks, microbatches, batches, first_batch)
