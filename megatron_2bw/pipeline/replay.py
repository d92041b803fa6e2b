"""Replay of every stage's action list in time: when each action starts and ends, given the
durations of the passes and transfers. The planner's simulator and the pictures read it; it also
finds a list that deadlocks (every stage waiting for a send that never comes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_2bw.pipeline.actions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                                           RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Action,
                                           ScheduleError, transfer_peer)

# a backward split into B and W takes about what the whole backward takes (F 1, B + W 2)
DEFAULT_DURATIONS = {FORWARD: 1.0, BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0}


@dataclass(frozen=True)
class TimedAction:
    stage: int
    action: Action
    start: float
    end: float


def timeline(actions: list[list[Action]], duration: Callable[[int, Action], float] | None = None,
             transfer: Callable[[int, int, Action], float] | None = None,
             shape: str = "loop") -> list[list[TimedAction]]:
    """Replay every stage's list in order. Sends never block; a receive starts once the matching
    send ended plus `transfer(src, dst, action)`. Raises ScheduleError naming each stuck stage."""
    duration = duration or (lambda stage, a: DEFAULT_DURATIONS.get(a.kind, 0.0))
    transfer = transfer or (lambda src, dst, a: 0.0)
    n = len(actions)
    sent: dict[tuple[int, str, int, int], float] = {}  # (stage, kind, microbatch, chunk) -> end
    clock = [0.0] * n
    position = [0] * n
    result: list[list[TimedAction]] = [[] for _ in range(n)]
    progress = True
    while progress:
        progress = False
        for s in range(n):
            while position[s] < len(actions[s]):
                a = actions[s][position[s]]
                start = clock[s]
                if a.kind in (RECV_ACT, RECV_GRAD):
                    src, send_kind, chunk = transfer_peer(s, a.kind, a.chunk, n, shape)
                    key = (src, send_kind, a.microbatch, chunk)
                    if key not in sent:
                        break
                    start = max(start, sent.pop(key) + transfer(src, s, a))
                end = start + duration(s, a)
                if a.kind in (SEND_ACT, SEND_GRAD):
                    sent[(s, a.kind, a.microbatch, a.chunk)] = end
                result[s].append(TimedAction(s, a, start, end))
                clock[s] = end
                position[s] += 1
                progress = True
    stuck = [s for s in range(n) if position[s] < len(actions[s])]
    if stuck:
        waits = "; ".join(f"stage {s} at action {position[s]} ({actions[s][position[s]]})"
                          for s in stuck)
        raise ScheduleError(f"deadlock: {waits} wait for sends that never come")
    if sent:
        (s, kind, k, chunk), _ = next(iter(sent.items()))
        raise ScheduleError(f"stage {s}: {Action(kind, k, chunk=chunk)} is never received")
    return result
