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

from megatron_2bw.pipeline.actions import (BACKWARD, COMM_KINDS, FORWARD, Action,
                                          end_of_flushed_batch, with_transfers)


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
    """One batch after another, each with Megatron-LM's grouping of transfers: after a warm-up
    forward its activation goes out with the receive of the next forward's input; in the steady
    state a forward and a backward run back to back, then both results go out with the receives
    of the next forward and backward in one exchange; in the drain each backward's gradient goes
    with the next one's receive. Posted per pass instead (receive before, send after), two ranks
    can each hold a send the other receives only in a later exchange: under NCCL, where a send
    waits for its receive and a rank's exchanges run in order, a deadlock
    (pipeline/nccl_replay.py)."""
    m = microbatches
    forwards = forward_order(stages, m, chunks)
    backwards = backward_order(stages, m, chunks)
    total = len(forwards)
    warmup = warmup_forwards(stages, m, stage, chunks)
    steady = total - warmup
    for b in range(first_batch, first_batch + batches):
        def parts(kind: str, i: int) -> tuple[list[Action], Action, list[Action]]:
            """The pass's receive (if any), the pass and its send (if any)."""
            if i >= total:
                return [], None, []
            chunk, j = (forwards if kind == FORWARD else backwards)[i]
            actions = list(with_transfers(kind, stages, stage, chunks, b * m + j, chunk, b))
            at = next(n for n, a in enumerate(actions) if a.kind not in COMM_KINDS)
            return actions[:at], actions[at], actions[at + 1:]

        def receive(kind: str, i: int) -> list[Action]:
            return parts(kind, i)[0]

        def compute(kind: str, i: int) -> Action:
            return parts(kind, i)[1]

        def send(kind: str, i: int) -> list[Action]:
            return parts(kind, i)[2]

        yield from receive(FORWARD, 0)
        for i in range(warmup):
            yield compute(FORWARD, i)
            yield from send(FORWARD, i) + receive(FORWARD, i + 1)
            if i == warmup - 1:
                yield from receive(BACKWARD, 0)
        for i in range(steady):
            yield compute(FORWARD, warmup + i)
            yield compute(BACKWARD, i)
            yield from send(FORWARD, warmup + i) + send(BACKWARD, i) + \
                receive(FORWARD, warmup + i + 1) + receive(BACKWARD, i + 1)
        if warmup == 0:
            yield from receive(BACKWARD, 0)
        for i in range(steady, total):
            yield compute(BACKWARD, i)
            yield from send(BACKWARD, i) + receive(BACKWARD, i + 1)
        yield from end_of_flushed_batch(b)
