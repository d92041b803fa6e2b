"""A V schedule's action lists from one batch's order of passes per rank (zb_v.py, dualpipe_v.py,
v_half.py): each pass with its transfers (a V's turn on the last rank has none), every receive in
its sender's order (NCCL matches a pair's transfers in posting order) and moved into an earlier
exchange where NCCL's blocking sends would otherwise deadlock (nccl_replay.grouped_for_nccl).
Vanilla: drained per batch, so batch b's lists are batch 0's with microbatches, versions and
batch numbers shifted by b."""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Callable, Iterator

from megatron_2bw.pipeline.actions import Action, flushed_batches, receives_in_send_order
from megatron_2bw.pipeline.nccl_replay import grouped_for_nccl

Order = Callable[[int, int, int], list[tuple[str, int, int]]]  # (p, m, rank) -> (kind, chunk, j)


@lru_cache(maxsize=64)
def _first_batch(order: Order, stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    rows = [list(flushed_batches(order(stages, microbatches, s), stages, s, 2, microbatches, 1, 0,
                                 "v")) for s in range(stages)]
    return tuple(map(tuple, grouped_for_nccl(receives_in_send_order(rows, "v"), "v")))


def _shifted(a: Action, batch: int, microbatches: int) -> Action:
    def plus(value: int | None, by: int) -> int | None:
        return None if value is None else value + by
    return dataclasses.replace(a, microbatch=plus(a.microbatch, batch * microbatches),
                               version=plus(a.version, batch), batch=plus(a.batch, batch))


def v_schedule_actions(order: Order, stages: int, microbatches: int, batches: int, stage: int,
                       first_batch: int) -> Iterator[Action]:
    template = _first_batch(order, stages, microbatches)[stage]
    for b in range(first_batch, first_batch + batches):
        for a in template:
            yield _shifted(a, b, microbatches)
