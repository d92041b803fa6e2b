"""Replay the schedule's action lists (pipeline/schedules.py) with the cost model's durations.

Each stage executes its list in order. Forward, backward, reduce_grads (its blocking part) and step
occupy the stage; a data-parallel average left running by reduce_grads must be in before the
stage's next backward or step, which marks the stage's reduce as done. A send never blocks its stage: the transfer starts when the link to
the neighbour is free (transfers on a link queue) and lands after the transfer time; a receive
waits for it. A step waits until every stage has reduced the batch (the grad-norm all-reduce spans
the model group) plus the stage's background collectives; under plain PipeDream
(`stage_local_steps`) for its own stage's reduce only (each stage decides its steps alone).

Two replays of the same rules: with a processor per rank each stage runs ahead on its own clock
(fast: the planner replays many candidates for large clusters); where ranks share a node's
processors (cost.CoreSharing, CPU ranks), one clock for all, on which the ranks computing at each
moment share their node's processors equally and a rank blocked in a collective or transfer
(the *_comm_s parts of its durations) needs none. There a forward or backward alternates compute
and its tensor-parallel collectives, as the runtime does, and each collective's wait for a peer's
turn (StageCost.wake_s) happens only while other ranks of the node have work (a peer loses its
turn only to a rank with work); during that wait the group's lagging peer computes, so the group
holds one processor. Ranks outnumbering the free processors also pay the stage's measured
turn-taking overhead (StageCost.turn_overhead), and a stage's replicas on the node count in its
load for the share of a pass they compute (_replica_duty), out of step with the replayed group.

The time per batch is taken in steady state, between the ends of the first and the next-to-last
batch's reduce: the first batch absorbs the pipeline fill, and under 2BW a batch also runs the
next batch's warm-up forwards, which the last batch lacks (3 batches give one steady interval).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.placement import Placement
from megatron_2bw.planner.cost import (INPUT_GRADIENT_SHARE, CoreSharing, StageCost,
                                       bottleneck_label, busiest_stage)

_CODES = {S.FORWARD: 0, S.BACKWARD: 1, S.SEND_ACT: 2, S.RECV_ACT: 3, S.SEND_GRAD: 4,
          S.RECV_GRAD: 5, S.REDUCE_GRADS: 6, S.STEP: 7, S.RELEASE_VERSION: 8,
          S.BACKWARD_INPUT: 9, S.BACKWARD_WEIGHT: 10}
PASSES = (0, 1, 9, 10)  # forward, backward, and the split backward's B and W


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


Compiled = tuple[tuple[tuple[int, int | None, int | None, int], ...], ...]


def compile_actions(actions: list[list[S.Action]]) -> Compiled:
    """Actions as (code, microbatch, batch, chunk) integer tuples: the replay loop's fast form."""
    return tuple(tuple((_CODES[a.kind], a.microbatch, a.batch, a.chunk) for a in stage)
                 for stage in actions)


def compiled_schedule(schedule: str, stages: int, microbatches: int, batches: int,
                      chunks: int = 1) -> Compiled:
    return compile_actions(S.build_schedule(schedule, stages, microbatches, batches, 0, chunks))


class _Replay:
    """The state both replays share, and the rules for transfers, receives and steps."""

    def __init__(self, compiled: Compiled, durations: list[StageCost], microbatches: int,
                 reduces: list[int], stage_local_steps: bool = False, shape: str = "loop"):
        p = len(compiled)
        self.stage_local_steps = stage_local_steps
        self.compiled, self.durations, self.m = compiled, durations, microbatches
        self.position = [0] * p
        self.act_arrival: list[dict[int, tuple[float, float]]] = [{} for _ in range(p)]
        self.grad_arrival: list[dict[int, tuple[float, float]]] = [{} for _ in range(p)]
        self.link_next = [0.0] * p  # when the link s -> s+1 is free
        self.link_prev = [0.0] * p  # s -> s-1
        self.reduce_end: list[dict[int, float]] = [{} for _ in range(p)]
        self.in_flight, self.peak = [0] * p, [0] * p
        self.p2p_wait = [dict.fromkeys(reduces, 0.0) for _ in range(p)]
        self.step_wait = [dict.fromkeys(reduces, 0.0) for _ in range(p)]  # batch's collectives
        self.stretch = [dict.fromkeys(reduces, 0.0) for _ in range(p)]  # slowed by sharing
        self.tied_first = p > 1 and durations[0].tied_async_s > 0
        self.step_arrival: dict[int, float] = {}  # batch -> when the first stage reached its step
        self.background: list[tuple[int, float] | None] = [None] * p  # (batch, when it is in)
        # interleaved and a V: a rank's chunks each take 1/v of its stage's pass
        self.chunks = 1 + max((a[3] for row in compiled for a in row), default=0)
        self.placement = Placement(p, self.chunks, shape)

    def pass_cost(self, s: int, code: int) -> tuple[float, float, float]:
        """(seconds, of them blocked in collectives, collectives) of a forward, backward, B or W
        of one chunk on stage s."""
        cost, v = self.durations[s], self.chunks
        if code == 0:
            return cost.forward_s / v, cost.forward_comm_s / v, cost.forward_collectives / v
        share = {1: 1.0, 9: INPUT_GRADIENT_SHARE, 10: 1.0 - INPUT_GRADIENT_SHARE}[code]
        comm_share = 0.0 if code == 10 else 1.0  # the collectives are on the input's path
        return (cost.backward_s * share / v, cost.backward_comm_s * comm_share / v,
                cost.backward_collectives * comm_share / v)

    def reduced(self, s: int, batch: int, t: float) -> None:
        """Stage s's reduce of `batch` ended at t, or left its data-parallel average running."""
        background = self.durations[s].reduce_background_s
        if background > 0:
            self.background[s] = (batch, t + background)
        else:
            self.reduce_end[s][batch] = t

    def finish_background(self, s: int, t: float) -> float:
        """Before a backward or step at t: when the running average is in (the stage's reduce
        then counts as done), waiting for it as data-parallel time."""
        batch, done = self.background[s]
        self.background[s] = None
        if done > t:
            self.step_wait[s][batch] += done - t
            t = done
        self.reduce_end[s][batch] = t
        return t

    def microbatch(self, s: int, code: int) -> None:
        """In-flight bookkeeping of a forward (code 0), backward (1) or W (10): a microbatch's
        activations live until its backward, or its W where the backward is split."""
        self.in_flight[s] += 1 if code == 0 else -1 if code in (1, 10) else 0
        self.peak[s] = max(self.peak[s], self.in_flight[s])

    def send(self, s: int, code: int, k: int, t: float, chunk: int = 0) -> None:
        """An activation (code 2) or gradient (4) transfer queued on its link at time t, to the
        neighbouring virtual stage (placement.py: a loop wraps from the last rank to the first; a
        V's chunk 1 runs up the ranks, so its activations take the link to s-1)."""
        cost = self.durations[s]
        placement = self.placement
        rank, their_chunk = placement.next(s, chunk) if code == 2 else placement.previous(s, chunk)
        seconds = cost.send_act_s if code == 2 else cost.send_grad_s
        down = (code == 2) != (placement.shape == "v" and chunk == 1)
        links = self.link_next if down else self.link_prev
        start = max(t, links[s])
        links[s] = start + seconds
        arrivals = self.act_arrival if code == 2 else self.grad_arrival
        arrivals[rank][k, their_chunk] = (start + seconds, seconds)

    def receive(self, s: int, code: int, k: int, t: float, chunk: int = 0) -> float | None:
        """When a receive (code 3: activation, 5: gradient) reached at time t completes; None if
        the transfer has not started. The part of the wait while the data was on the wire counts
        as p2p time."""
        arrival = (self.act_arrival if code == 3 else self.grad_arrival)[s].pop((k, chunk), None)
        if arrival is None:
            return None
        landed, transfer = arrival
        if landed > t:
            self.p2p_wait[s][k // self.m] += min(landed - t, transfer)
            return landed
        return t

    def step_ready(self, s: int, batch: int, t: float) -> float | None:
        """When a step reached at time t can run; None until every stage's reduce is placed."""
        durations = self.durations
        deciding = [s] if self.stage_local_steps else range(len(durations))
        if any(batch not in self.reduce_end[x] for x in deciding):
            return None
        cost = durations[s]
        ready = max(self.reduce_end[x][batch] for x in deciding) + cost.reduce_async_s
        if self.tied_first:  # the first stage adds its norm part at its own step, once the
            if s == 0:  # tied-embedding sum has arrived
                self.step_arrival.setdefault(batch, t)
            elif batch not in self.step_arrival:
                return None
            first_ready = max(self.reduce_end[0][batch] + durations[0].tied_async_s,
                              self.step_arrival[batch])
            ready = max(ready, first_ready + cost.reduce_async_s)
        if ready > t:
            self.step_wait[s][batch] += ready - t
            return ready
        return t


def _replay_own_processors(replay: _Replay) -> None:
    """Every rank has a processor: each stage runs ahead on its own clock until it must wait."""
    compiled, durations = replay.compiled, replay.durations
    p = len(compiled)
    clock = [0.0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            actions_s, cost = compiled[s], durations[s]
            i, t = replay.position[s], clock[s]
            while i < len(actions_s):
                code, k, batch, chunk = actions_s[i]
                if code in (1, 7, 9, 10) and replay.background[s] is not None:
                    t = clock[s] = replay.finish_background(s, t)
                    progress = True
                if code in PASSES:
                    replay.microbatch(s, code)
                    t += replay.pass_cost(s, code)[0]
                elif code in (2, 4):
                    replay.send(s, code, k, t, chunk)
                elif code in (3, 5):
                    done = replay.receive(s, code, k, t, chunk)
                    if done is None:
                        break
                    t = done
                elif code == 6:
                    t += cost.reduce_s
                    replay.reduced(s, batch, t)
                elif code == 7:
                    ready = replay.step_ready(s, batch, t)
                    if ready is None:
                        break
                    t = ready + cost.step_s
                i += 1
            if i != replay.position[s]:
                replay.position[s], clock[s] = i, t
                progress = True


_DONE = 1e-12  # seconds: a segment this close to its end has ended
_WAITS = ("until", "idle", "held")  # segments that end at a time


def _turn_rate(free: float, load: float, turn_overhead: float) -> float:
    """The speed of each of `load` ranks computing on `free` processors of a node whose ranks
    take turns (turn_overhead; 0 where each rank has a processor): full speed while each has one,
    else an equal share, slowed by the overhead throughout."""
    return (1.0 if load <= free else free / load) / (1.0 + turn_overhead)


def _replica_duty(cost: StageCost, ranks: int, sharing: CoreSharing, turn_overhead: float
                  ) -> float:
    """The share of a pass the other tensor-parallel groups of a stage (its replicas) compute:
    they drift out of step with the replayed group, each computing while the others wait in
    their collectives. A fixed point of: the replicas compute at the node's speed for all that
    compute, and wait as long as the collectives take."""
    work = cost.forward_s - cost.forward_comm_s + cost.backward_s - cost.backward_comm_s
    comm = cost.forward_comm_s + cost.backward_comm_s
    if comm <= 0.0 or work <= 0.0:
        return 1.0
    t = sharing.tensor_parallel
    duty = 1.0
    for _ in range(50):
        rate = _turn_rate(sharing.slots, t + (ranks - t) * duty, turn_overhead)
        duty = (work / rate) / (work / rate + comm)
    return duty


def _replay_sharing_processors(replay: _Replay, sharing: CoreSharing) -> None:
    """Ranks share their node's processors: one clock; an action is a list of segments, ("cpu",
    seconds of work at full speed), ("wall", seconds) or ("until", time) spent blocked without a
    processor in a collective or transfer, ("idle", time) waiting for another stage (a receive,
    the batch's step), ("wake", seconds) waiting for a peer's turn, which becomes ("held", time)
    if the node has other ranks with work and is skipped otherwise, ("reduced", batch) marking
    the end of a reduce. The ranks computing at a moment share their node's processors equally
    (all ranks of a stage behave alike), less one processor per tensor-parallel group in a held
    wait."""
    compiled, durations, m = replay.compiled, replay.durations, replay.m
    p = len(compiled)
    # per node, its stages; per stage, whether other groups of it (replicas) share a node with it
    node_stages = [[s for s in range(p) if node[s]] for node in sharing.ranks]
    replicas = [any(node[s] > sharing.tensor_parallel for node in sharing.ranks) for s in range(p)]
    # per node: whether its ranks take turns, and so pay their compute's turn-taking overhead
    crowded = [sharing.crowded(n) for n in range(len(sharing.ranks))]

    def overhead(s: int, n: int) -> float:
        return durations[s].turn_overhead if crowded[n] else 0.0

    duty = [_replica_duty(durations[s], max(node[s] for node in sharing.ranks), sharing,
                          max(overhead(s, n) for n, node in enumerate(sharing.ranks) if node[s]))
            for s in range(p)]
    t_ranks = sharing.tensor_parallel
    # per node and stage: the ranks of the replayed group, and the replicas' load during a pass
    group_ranks = [[min(n, t_ranks) for n in node] for node in sharing.ranks]
    replica_load = [[max(n - t_ranks, 0) * duty[s] for s, n in enumerate(node)]
                    for node in sharing.ranks]
    in_pass = [False] * p
    segments: list[list[list]] = [[] for _ in range(p)]
    batch_of = [0] * p  # the batch of each stage's current action
    reached: list[float | None] = [None] * p  # when a blocked stage reached its action
    now = 0.0

    def begin(s: int) -> bool:
        """Start stage s's next action at `now`; False if it must wait for another stage."""
        code, k, batch, chunk = compiled[s][replay.position[s]]
        cost, t = durations[s], now if reached[s] is None else reached[s]
        if code in (1, 7, 9, 10) and replay.background[s] is not None:
            segments[s] = [["until", replay.finish_background(s, t)]]  # then the action begins
            reached[s] = None
            in_pass[s] = False
            return True
        in_pass[s] = code in PASSES
        if code in PASSES:
            replay.microbatch(s, code)
            work, comm, calls = replay.pass_cost(s, code)
            wake = calls * cost.wake_s
            pieces = max(1, round(calls))
            segments[s] = [list(segment) for _ in range(pieces) for segment in
                           (("cpu", (work - comm) / pieces),
                            ("wall", max(comm - wake, 0.0) / pieces), ("wake", wake / pieces))]
            batch = k // m
        elif code in (2, 4):
            replay.send(s, code, k, t, chunk)
        elif code in (3, 5):
            done = replay.receive(s, code, k, t, chunk)
            if done is None:
                reached[s] = t
                return False
            segments[s] = [["idle", done]]
        elif code == 6:
            segments[s] = [["cpu", cost.reduce_s], ["reduced", batch]]
        elif code == 7:
            ready = replay.step_ready(s, batch, t)
            if ready is None:
                reached[s] = t
                return False
            segments[s] = [["idle", ready], ["cpu", cost.step_s - cost.step_comm_s],
                           ["wall", cost.step_comm_s]]
        reached[s] = None
        batch_of[s] = batch
        replay.position[s] += 1
        return True

    def has_work(s: int) -> bool:
        """Stage s is not waiting for another stage at `now`."""
        if segments[s]:
            return segments[s][0][0] != "idle"
        return reached[s] is None and replay.position[s] < len(compiled[s])

    def others_have_work(s: int) -> bool:
        """A rank outside stage s's tensor-parallel group, on one of its nodes, has work."""
        return replicas[s] or any(has_work(x) for stages in node_stages if s in stages
                                  for x in stages if x != s)

    def settle(s: int) -> bool:
        """Drop the ended segments of stage s at `now`; True if its action ended."""
        current = segments[s]
        while current:
            kind, value = current[0]
            if kind == "wall":
                current[0] = ["until", now + value]
            elif kind == "wake":
                if others_have_work(s):
                    current[0] = ["held", now + value]
                else:
                    current.pop(0)
            elif kind == "reduced":
                replay.reduced(s, value, now)
                current.pop(0)
            elif (kind == "cpu" and value <= _DONE) or (kind in _WAITS and value <= now + _DONE):
                current.pop(0)
            else:
                return False
        return True

    while True:
        moved = True
        while moved:  # every stage goes as far as it can at `now`
            moved = False
            for s in range(p):
                ended = bool(segments[s]) and settle(s)
                while not segments[s] and replay.position[s] < len(compiled[s]) and begin(s):
                    settle(s)
                    ended = True
                moved = moved or ended
        computing = [s for s in range(p) if segments[s] and segments[s][0][0] == "cpu"]
        waits = [segments[s][0][1] for s in range(p) if segments[s] and segments[s][0][0] in _WAITS]
        if not computing and not waits:
            return  # finished, or deadlocked (simulate reports it)
        holding = [s for s in range(p) if segments[s] and segments[s][0][0] == "held"]
        # in a pass a stage's replicas compute for their duty's share of the time, whether the
        # replayed group computes or waits; elsewhere (reduce, step) all its ranks compute alike
        load = [sum(group[s] if in_pass[s] else node[s] for s in computing)
                + sum(extra[s] for s in range(p)
                      if in_pass[s] and segments[s] and segments[s][0][0] != "idle")
                for node, group, extra in zip(sharing.ranks, group_ranks, replica_load)]
        free = [max(sharing.slots - sum(node[s] for s in holding) / sharing.tensor_parallel, 0.0)
                for node in sharing.ranks]
        rate = {s: min(_turn_rate(free[n], load[n], overhead(s, n))
                       for n, node in enumerate(sharing.ranks) if node[s]) for s in computing}
        finish = {s: now + segments[s][0][1] / rate[s] if rate[s] else float("inf")
                  for s in computing}  # no rate: lagging peers hold every processor
        next_time = min([*finish.values(), *waits])
        for s in computing:
            segment = segments[s][0]
            segment[1] = 0.0 if finish[s] <= next_time + _DONE else \
                segment[1] - rate[s] * (next_time - now)
            replay.stretch[s][batch_of[s]] += (1.0 - rate[s]) * (next_time - now)
        now = next_time


def simulate(actions: list[list[S.Action]] | Compiled, durations: list[StageCost],
             activation_bytes: list[float] | None = None,
             sharing: CoreSharing | None = None, stage_local_steps: bool = False,
             shape: str = "loop") -> SimResult:
    """Replay every stage's actions with `durations` (one StageCost per stage); `sharing`: how the
    ranks share their nodes' processors, if they do; `stage_local_steps`: each stage's step waits
    for its own reduce only (schedules.VersionRule.global_step_decisions false: PipeDream);
    `shape`: where the chunks sit (placement.py; "v" for the V schedules)."""
    compiled = actions if actions and actions[0] and isinstance(actions[0][0], tuple) \
        else compile_actions(actions)
    p = len(compiled)
    if len(durations) != p:
        raise ValueError(f"{len(durations)} stage durations for {p} stages")
    reduces = [c[2] for c in compiled[0] if c[0] == 6]
    forwards = sum(1 for c in compiled[0] if c[0] == 0 and c[3] == 0)
    if len(reduces) < 3:
        raise ValueError("simulate needs at least 3 batches to measure a steady time per batch")
    m = forwards // len(reduces)

    replay = _Replay(compiled, durations, m, reduces, stage_local_steps, shape)
    if sharing is None:
        _replay_own_processors(replay)
    else:
        _replay_sharing_processors(replay, sharing)
    stuck = [s for s in range(p) if replay.position[s] < len(compiled[s])]
    if stuck:
        raise S.ScheduleError(f"simulation deadlocked at stages {stuck}")

    # Steady batches: not the first (it fills the pipeline) and not the last (2BW runs the next
    # batch's warm-up forwards inside a batch; the last batch has no next one). A short replay can
    # still borrow from the slack a pipeline starts with (a stage slowed by a long step falls
    # behind only gradually): in steady state no stage takes less than its busy time per batch,
    # nor a node less than its ranks' processor time over its processors.
    ends = [max(replay.reduce_end[s][b] for s in range(p)) for b in reduces]
    intervals = len(reduces) - 2
    busiest = busiest_stage(durations, m)
    cost = durations[busiest]
    busy = m * (cost.forward_s + cost.backward_s) + cost.reduce_s + cost.step_s
    # ranks sharing processors skip the waits for a peer's turn while the rest of the node idles
    skippable = m * (cost.forward_collectives + cost.backward_collectives) * cost.wake_s \
        if sharing else 0.0
    floor = max(busy - skippable, sharing.bound(durations, m) if sharing else 0.0)
    time_per_batch = max((ends[-2] - ends[0]) / intervals, floor)
    steady = reduces[1:-1]

    def per_batch(values: dict[int, float]) -> float:
        return sum(values[b] for b in steady) / intervals

    breakdown = {"compute": m * (cost.forward_s + cost.backward_s),
                 "data_parallel": cost.reduce_s + cost.step_s + per_batch(replay.step_wait[busiest]),
                 "p2p": per_batch(replay.p2p_wait[busiest])}
    if sharing is not None:
        breakdown["shared_cores"] = per_batch(replay.stretch[busiest])
    breakdown["bubble"] = max(time_per_batch - sum(breakdown.values()), 0.0)
    activation_bytes = activation_bytes or [0.0] * p
    return SimResult(
        time_per_batch=time_per_batch,
        bubble_fraction=max(1.0 - busy / time_per_batch, 0.0) if time_per_batch else 0.0,
        peak_inflight_microbatches=replay.peak,
        peak_activation_bytes=[n * a / replay.chunks for n, a in zip(replay.peak, activation_bytes)],
        busiest_stage=busiest,
        breakdown=breakdown)
