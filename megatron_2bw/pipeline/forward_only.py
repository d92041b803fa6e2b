"""Evaluation's action lists: forwards only, with the newest weights, in every schedule."""
from __future__ import annotations

from typing import Iterator

from megatron_2bw.pipeline import interleaved
from megatron_2bw.pipeline.actions import FORWARD, RECV_ACT, SEND_ACT, Action


def forward_only_actions(stages: int, microbatches: int, stage: int,
                         chunks: int = 1) -> Iterator[Action]:
    """Forwards of `microbatches` microbatches with the newest weights (version None); with
    chunks, in the interleaved order (microbatches in groups of p through each chunk)."""
    if chunks > 1:
        order = interleaved.forward_order(stages, microbatches, chunks)
    else:
        order = [(0, k) for k in range(microbatches)]
    for c, k in order:
        if stage > 0 or c > 0:
            yield Action(RECV_ACT, k, chunk=c)
        yield Action(FORWARD, k, chunk=c)
        if stage < stages - 1 or c < chunks - 1:
            yield Action(SEND_ACT, k, chunk=c)
