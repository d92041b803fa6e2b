"""Replay the schedule's action lists (pipeline/schedules.py) with the cost model's durations.

Event-driven: each stage executes its list in order on one clock. Forward, backward, reduce_grads
(the blocking data-parallel part) and step occupy the stage. A send never blocks its stage: the
transfer starts when the link to the neighbour is free (transfers on a link queue) and lands after
the transfer time; a receive waits for it. A step waits until every stage has reduced the batch
(the grad-norm all-reduce spans the model group) plus the stage's background collectives.

The time per batch is taken in steady state, between the ends of the first and the next-to-last
batch's reduce: the first batch absorbs the pipeline fill, and under 2BW a batch also runs the
next batch's warm-up forwards, which the last batch lacks (3 batches give one steady interval).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_2bw.pipeline import schedules as S
from megatron_2bw.planner.cost import StageCost, bottleneck_label, busiest_stage

_CODES = {S.FORWARD: 0, S.BACKWARD: 1, S.SEND_ACT: 2, S.RECV_ACT: 3, S.SEND_GRAD: 4,
          S.RECV_GRAD: 5, S.REDUCE_GRADS: 6, S.STEP: 7, S.RELEASE_VERSION: 8}


@dataclass(frozen=True)
class SimResult:
    time_per_batch: float  # seconds, steady state
    bubble_fraction: float  # idle share of the busiest stage's time per batch
    peak_inflight_microbatches: list[int]  # per stage
    peak_activation_bytes: list[float]  # per stage: peak in flight x bytes per microbatch
    busiest_stage: int
    # the busiest stage's time per batch: compute, data_parallel (reduce, step and waiting for the
    # batch's collectives), p2p (waiting for transfers in flight), bubble (waiting for other stages)
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def bottleneck(self) -> str:
        return bottleneck_label(self.breakdown, self.busiest_stage)


Compiled = tuple[tuple[tuple[int, int | None, int | None], ...], ...]


def compile_actions(actions: list[list[S.Action]]) -> Compiled:
    """Actions as (code, microbatch, batch) integer tuples: the replay loop's fast form."""
    return tuple(tuple((_CODES[a.kind], a.microbatch, a.batch) for a in stage) for stage in actions)


def compiled_schedule(schedule: str, stages: int, microbatches: int, batches: int) -> Compiled:
    return compile_actions(S.build_schedule(schedule, stages, microbatches, batches))


def simulate(actions: list[list[S.Action]] | Compiled, durations: list[StageCost],
             activation_bytes: list[float] | None = None) -> SimResult:
    """Replay every stage's actions with `durations` (one StageCost per stage)."""
    compiled = actions if actions and actions[0] and isinstance(actions[0][0], tuple) \
        else compile_actions(actions)
    p = len(compiled)
    if len(durations) != p:
        raise ValueError(f"{len(durations)} stage durations for {p} stages")
    reduces = [c[2] for c in compiled[0] if c[0] == 6]
    forwards = sum(1 for c in compiled[0] if c[0] == 0)
    if len(reduces) < 3:
        raise ValueError("simulate needs at least 3 batches to measure a steady time per batch")
    m = forwards // len(reduces)

    clock = [0.0] * p
    position = [0] * p
    act_arrival: list[dict[int, tuple[float, float]]] = [{} for _ in range(p)]
    grad_arrival: list[dict[int, tuple[float, float]]] = [{} for _ in range(p)]
    link_next = [0.0] * p  # when the link s -> s+1 is free
    link_prev = [0.0] * p  # s -> s-1
    reduce_end: list[dict[int, float]] = [{} for _ in range(p)]
    in_flight, peak = [0] * p, [0] * p
    p2p_wait = [dict.fromkeys(reduces, 0.0) for _ in range(p)]
    step_wait = [dict.fromkeys(reduces, 0.0) for _ in range(p)]  # for the batch's collectives
    tied_first = p > 1 and durations[0].tied_async_s > 0
    step_arrival: dict[int, float] = {}  # batch -> when the first stage reached its step

    def wait(s: int, batch: int, start: float, arrival: tuple[float, float]) -> float:
        """Advance to an arrival (time, transfer seconds); the part of the wait while the data
        was on the wire counts as p2p time."""
        landed, transfer = arrival
        if landed > start:
            p2p_wait[s][batch] += min(landed - start, transfer)
            return landed
        return start

    progress = True
    while progress:
        progress = False
        for s in range(p):
            actions_s, cost = compiled[s], durations[s]
            i, t = position[s], clock[s]
            while i < len(actions_s):
                code, k, batch = actions_s[i]
                if code == 0:
                    t += cost.forward_s
                    in_flight[s] += 1
                    peak[s] = max(peak[s], in_flight[s])
                elif code == 1:
                    t += cost.backward_s
                    in_flight[s] -= 1
                elif code == 3:
                    arrival = act_arrival[s].pop(k, None)
                    if arrival is None:
                        break
                    t = wait(s, k // m, t, arrival)
                elif code == 5:
                    arrival = grad_arrival[s].pop(k, None)
                    if arrival is None:
                        break
                    t = wait(s, k // m, t, arrival)
                elif code == 2:
                    start = max(t, link_next[s])
                    link_next[s] = start + cost.send_act_s
                    act_arrival[s + 1][k] = (start + cost.send_act_s, cost.send_act_s)
                elif code == 4:
                    start = max(t, link_prev[s])
                    link_prev[s] = start + cost.send_grad_s
                    grad_arrival[s - 1][k] = (start + cost.send_grad_s, cost.send_grad_s)
                elif code == 6:
                    t += cost.reduce_s
                    reduce_end[s][batch] = t
                elif code == 7:
                    if any(batch not in reduce_end[x] for x in range(p)):
                        break
                    ready = max(reduce_end[x][batch] for x in range(p)) + cost.reduce_async_s
                    if tied_first:  # the first stage adds its norm part at its own step, once
                        if s == 0:  # the tied-embedding sum has arrived
                            step_arrival.setdefault(batch, t)
                        elif batch not in step_arrival:
                            break
                        first_ready = max(reduce_end[0][batch] + durations[0].tied_async_s,
                                          step_arrival[batch])
                        ready = max(ready, first_ready + cost.reduce_async_s)
                    if ready > t:
                        step_wait[s][batch] += ready - t
                        t = ready
                    t += cost.step_s
                i += 1
            if i != position[s]:
                position[s], clock[s] = i, t
                progress = True
    stuck = [s for s in range(p) if position[s] < len(compiled[s])]
    if stuck:
        raise S.ScheduleError(f"simulation deadlocked at stages {stuck}")

    # Steady batches: not the first (it fills the pipeline) and not the last (2BW runs the next
    # batch's warm-up forwards inside a batch; the last batch has no next one). A short replay can
    # still borrow from the slack a pipeline starts with (a stage slowed by a long step falls
    # behind only gradually): in steady state no stage takes less than its busy time per batch.
    ends = [max(reduce_end[s][b] for s in range(p)) for b in reduces]
    intervals = len(reduces) - 2
    busiest = busiest_stage(durations, m)
    cost = durations[busiest]
    busy = m * (cost.forward_s + cost.backward_s) + cost.reduce_s + cost.step_s
    time_per_batch = max((ends[-2] - ends[0]) / intervals, busy)
    steady = reduces[1:-1]

    def per_batch(values: dict[int, float]) -> float:
        return sum(values[b] for b in steady) / intervals

    compute = m * (cost.forward_s + cost.backward_s)
    data_parallel = cost.reduce_s + cost.step_s + per_batch(step_wait[busiest])
    p2p = per_batch(p2p_wait[busiest])
    bubble = max(time_per_batch - compute - data_parallel - p2p, 0.0)
    activation_bytes = activation_bytes or [0.0] * p
    return SimResult(
        time_per_batch=time_per_batch,
        bubble_fraction=max(1.0 - busy / time_per_batch, 0.0) if time_per_batch else 0.0,
        peak_inflight_microbatches=peak,
        peak_activation_bytes=[n * a for n, a in zip(peak, activation_bytes)],
        busiest_stage=busiest,
        breakdown={"compute": compute, "data_parallel": data_parallel, "p2p": p2p,
                   "bubble": bubble})

