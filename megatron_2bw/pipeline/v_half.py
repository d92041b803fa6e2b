"""V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362).

Two model chunks per rank in a V (placement.py), the backward split into B (input gradient) and W
(weight gradient) as in ZB-V, but every rank holds at most `activation_budget(p)` microbatch-chunks
(each half a 1F1B stage's activations): p + 2 rounded up to even, the paper's (p + 2) // 2
microbatches, about half of 1F1B's p. A pass's activations live from its forward to its W.

The order of one batch comes from a replay of all ranks in unit steps (F = B = W = 1 per chunk)
where each idle rank takes, of what is ready: a B (chunk 1 first: it carries the older
microbatch), else a forward within the budget (chunk 1 first), else the oldest waiting W. A
chunk-0 forward also reserves the room of that microbatch's chunk-1 forward on the same rank, so
a chunk-1 forward never waits for memory and the lists cannot deadlock: the microbatches a rank
admitted always finish their round trip. Vanilla: drained per batch.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterator

from megatron_2bw.pipeline.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from megatron_2bw.pipeline.placement import Placement
from megatron_2bw.pipeline.v_batches import v_schedule_actions

F, B, W = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT


def activation_budget(stages: int) -> int:
    """Microbatch-chunks a rank may hold: 2 * ((p + 2) // 2), the paper's V-Half figure."""
    return 2 * ((stages + 2) // 2)


@lru_cache(maxsize=64)
def v_half_orders(stages: int, microbatches: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """(kind, chunk, j) of one batch on every rank (j: the microbatch's index in the batch)."""
    p, m = stages, microbatches
    placement = Placement(p, 2, "v")
    budget = activation_budget(p)
    done: set[tuple[str, int, int, int]] = set()  # (kind, rank, chunk, j) finished
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    held = [0] * p  # activations alive plus chunk-1 room reserved by chunk-0 forwards
    next_forward = [[0, 0] for _ in range(p)]
    next_backward = [[0, 0] for _ in range(p)]
    waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]

    def input_ready(kind: str, rank: int, chunk: int, j: int) -> bool:
        neighbour = placement.previous(rank, chunk) if kind == F else placement.next(rank, chunk)
        if neighbour is None:
            return True
        return (F if kind == F else B, neighbour[0], neighbour[1], j) in done

    def pick(rank: int) -> tuple[str, int, int] | None:
        for chunk in (1, 0):
            j = next_backward[rank][chunk]
            if j < next_forward[rank][chunk] and input_ready(B, rank, chunk, j):
                return B, chunk, j
        for chunk in (1, 0):
            j = next_forward[rank][chunk]
            room = 0 if chunk == 1 else 2  # chunk 1's room was reserved by its chunk-0 forward
            if j < m and held[rank] + room <= budget and input_ready(F, rank, chunk, j):
                return F, chunk, j
        if waiting_w[rank]:
            return W, *waiting_w[rank][0]
        return None

    while any(len(order) < 6 * m for order in orders):
        step = [pick(r) for r in range(p)]
        if not any(step):
            raise AssertionError(f"v-half order stalls at p={p}, m={m}")  # the reserve rules it out
        for r, action in enumerate(step):
            if action is None:
                continue
            kind, chunk, j = action
            orders[r].append(action)
            if kind == F:
                next_forward[r][chunk] += 1
                held[r] += 2 if chunk == 0 else 0
            elif kind == B:
                next_backward[r][chunk] += 1
                waiting_w[r].append((chunk, j))
            else:
                waiting_w[r].pop(0)
                held[r] -= 1
        done.update((kind, r, chunk, j) for r, (kind, chunk, j) in
                    ((r, a) for r, a in enumerate(step) if a is not None))
    return tuple(tuple(order) for order in orders)


def v_half_order(stages: int, microbatches: int, stage: int) -> list[tuple[str, int, int]]:
    return list(v_half_orders(stages, microbatches)[stage])


def v_half_actions(stages: int, microbatches: int, batches: int, stage: int, first_batch: int = 0,
                   chunks: int = 2) -> Iterator[Action]:
    yield from v_schedule_actions(v_half_order, stages, microbatches, batches, stage, first_batch)
