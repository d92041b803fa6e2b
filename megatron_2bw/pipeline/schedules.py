"""Pipeline schedules as data: per-stage lists of actions, a validator, a timeline and a text picture.

The runtime executor, the planner's simulator and the schedule picture all consume these lists, so
there is exactly one definition of each schedule.

Schedules (p stages, m microbatches per batch, batches numbered from 0):
- "2bw"   PipeDream-2BW: one 1F1B sequence over all microbatches of all batches (stage r runs p-r-1
          warm-up forwards once), never drained. Batch b uses weight version max(b-1, 0). After its
          last backward of batch b a stage reduces the batch's gradients; the step that creates
          version b+1 is deferred until that version is first needed (first forward of batch b+2) or
          the gradient buffer is needed again (reduce of batch b+1), so cross-stage decisions
          (global grad norm, fp16 overflow) complete in the background. In the segment's final
          drain, where those forwards are missing, the step keeps the slot the forward would have
          had, so the stages' steps stay in their steady-state order (the first stage's, which the
          others' wait for, before the later stages need theirs).
- "flush" PipeDream-Flush: 1F1B drained after every batch; batch b uses version b (vanilla).
- "gpipe" GPipe: all forwards of a batch, then all backwards, drained after every batch.
- "pipedream" PipeDream (weight stashing): 2BW's never-drained 1F1B sequence, but batch b on stage s
          of p uses version max(0, b - (p-1-s)): the newest version a stage has when the batch
          reaches it with one microbatch per batch (m = 1, PipeDream's own setting, allowed here),
          so stage s stashes up to p - s versions. With m > 1 a batch accumulates m microbatches
          per update under the same rule. Steps are deferred like 2BW's (until the version is
          needed or the gradient buffer is). Its step decisions (clipping norm, overflow) are each
          stage's own: a global one would stall, since stage s > 0 needs version b+1 before the
          first stage has computed its gradient of batch b (see pipeline/update.py).
- "pipedream-vs" PipeDream with vertical sync (--pipeline-schedule pipedream --vertical-sync):
          every stage uses the version the first stage uses, max(0, b - (p-1)): a uniform delay of
          p - 1 updates, so global step decisions complete in the background as under 2BW.
A training run is cut into segments (at evaluation and checkpoint points); each segment is one call
with `first_batch` and `batches`, ends drained, and leaves every step of its batches done. The
weight-version rule depends only on batch indices, so segmenting never changes the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

FORWARD, BACKWARD = "forward", "backward"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"
REDUCE_GRADS, STEP, RELEASE_VERSION = "reduce_grads", "step", "release_version"
COMPUTE_KINDS = (FORWARD, BACKWARD)
COMM_KINDS = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)
SCHEDULES = ("2bw", "flush", "gpipe", "pipedream", "pipedream-vs")
# one 1F1B sequence over every batch of a segment, steps deferred until their version is needed
NEVER_DRAINED = ("2bw", "pipedream", "pipedream-vs")


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int | None = None  # global index k = batch * m + j
    version: int | None = None  # used (forward/backward), created (step) or freed (release)
    batch: int | None = None  # for reduce_grads and step

    def __str__(self) -> str:
        if self.kind in COMPUTE_KINDS:
            return f"{self.kind[0].upper()}{self.microbatch}@v{self.version}"
        if self.kind in COMM_KINDS:
            return f"{self.kind}({self.microbatch})"
        if self.kind == RELEASE_VERSION:
            return f"release(v{self.version})"
        return f"{self.kind}(b{self.batch}->v{self.version})" if self.kind == STEP else \
            f"{self.kind}(b{self.batch})"


class ScheduleError(ValueError):
    """An action list breaks a rule; the message names the stage, position and rule."""


def update_delay(schedule: str, stage: int = 0, stages: int = 1) -> int:
    """How many updates behind the newest weights a stage's batches run: batch b reads version
    max(0, b - delay)."""
    if schedule == "2bw":
        return 1
    if schedule == "pipedream":
        return stages - 1 - stage
    if schedule == "pipedream-vs":
        return stages - 1
    return 0


def version_for_batch(schedule: str, batch: int, stage: int = 0, stages: int = 1) -> int:
    """The weight version batch `batch` reads on `stage` of `stages` (forward and backward alike)."""
    return max(batch - update_delay(schedule, stage, stages), 0)


def live_versions(schedule: str, stages: int = 1, stage: int = 0) -> int:
    """The most weight versions `stage` holds at once (the validator checks it): the delay plus
    one, from the version its oldest batch in flight reads to the newest: 1 for the flushed
    schedules, 2 for 2BW, p - s for PipeDream, p on every stage under vertical sync."""
    return update_delay(schedule, stage, stages) + 1


@dataclass(frozen=True)
class VersionRule:
    """The weight-version rule of one stage: which version each batch reads and how many
    versions the stage holds at most (what WeightVersions allocates)."""
    schedule: str
    stages: int = 1
    stage: int = 0

    def version_for_batch(self, batch: int) -> int:
        return version_for_batch(self.schedule, batch, self.stage, self.stages)

    @property
    def live_versions(self) -> int:
        return live_versions(self.schedule, self.stages, self.stage)

    @property
    def global_step_decisions(self) -> bool:
        """Whether a step waits for every stage's gradient norm (clipping, overflow): all but
        plain PipeDream, whose later stages need a new version before the first stage's gradient
        of that update exists."""
        return self.schedule != "pipedream" or self.stages == 1


def max_in_flight(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """Microbatches whose activations a stage holds at once."""
    return microbatches if schedule == "gpipe" else min(stages - stage, microbatches) \
        if schedule == "flush" else stages - stage


def _check_args(schedule: str, stages: int, microbatches: int, batches: int, stage: int):
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
    if stages < 1 or microbatches < 1 or batches < 0 or not 0 <= stage < stages:
        raise ValueError(f"bad schedule shape: stages={stages} microbatches={microbatches} "
                         f"batches={batches} stage={stage}")
    if schedule in ("2bw", "flush") and microbatches < stages:
        raise ValueError(f"{schedule} needs microbatches per batch >= stages (1F1B keeps up to p "
                         f"microbatches in flight): got m={microbatches} < p={stages}")


def stage_actions(schedule: str, stages: int, microbatches: int, batches: int, stage: int,
                  first_batch: int = 0) -> Iterator[Action]:
    """The ordered actions of one stage for batches first_batch .. first_batch+batches-1 (lazy)."""
    _check_args(schedule, stages, microbatches, batches, stage)
    first, last = stage == 0, stage == stages - 1
    m = microbatches
    end_batch = first_batch + batches
    pending_steps: list[int] = []  # never-drained schedules: batches whose step is deferred
    deferred = schedule in NEVER_DRAINED

    def version_of_batch(b: int) -> int:
        return version_for_batch(schedule, b, stage, stages)

    def version(k: int) -> int:
        return version_of_batch(k // m)

    def flush_pending_steps():
        while pending_steps:
            b = pending_steps.pop(0)
            yield Action(STEP, version=b + 1, batch=b)

    def steps_due_before_forward(k: int):
        if deferred and pending_steps and version(k) > pending_steps[0]:
            yield from flush_pending_steps()

    def forward(k: int):
        yield from steps_due_before_forward(k)
        if not first:
            yield Action(RECV_ACT, k)
        yield Action(FORWARD, k, version(k))
        if not last:
            yield Action(SEND_ACT, k)

    def backward(k: int):
        if not last:
            yield Action(RECV_GRAD, k)
        yield Action(BACKWARD, k, version(k))
        if not first:
            yield Action(SEND_GRAD, k)
        if k % m == m - 1:  # the batch's last backward on this stage
            yield from end_of_batch(k // m)

    def end_of_batch(b: int):
        v = version_of_batch(b)
        if deferred:
            if version_of_batch(b + 1) != v:
                yield Action(RELEASE_VERSION, version=v)
            yield from flush_pending_steps()  # reduce_grads(b) needs the gradient buffer
            yield Action(REDUCE_GRADS, batch=b)
            pending_steps.append(b)
        else:
            yield Action(REDUCE_GRADS, batch=b)
            yield Action(RELEASE_VERSION, version=v)
            yield Action(STEP, version=b + 1, batch=b)

    def one_f_one_b(ks: list[int]):
        warmup = min(stages - stage - 1, len(ks))
        for k in ks[:warmup]:
            yield from forward(k)
        for i, k in enumerate(ks[warmup:]):
            yield from forward(k)
            yield from backward(ks[i])
        for k in ks[len(ks) - warmup:]:  # the drain: backward k where forward k+warmup would be
            yield from steps_due_before_forward(k + warmup)
            yield from backward(k)

    if deferred:
        yield from one_f_one_b(list(range(first_batch * m, end_batch * m)))
        yield from flush_pending_steps()
    else:
        for b in range(first_batch, end_batch):
            ks = list(range(b * m, (b + 1) * m))
            if schedule == "flush":
                yield from one_f_one_b(ks)
            else:
                for k in ks:
                    yield from forward(k)
                for k in ks:
                    yield from backward(k)


def stage_receives(stages: int, microbatches: int, batches: int, stage: int) -> dict[str, int]:
    """How many activations ("act") and gradients ("grad") the stage receives over `batches`
    batches, in every schedule: one of each per microbatch, except at the pipeline's ends."""
    count = microbatches * batches
    return {"act": count if stage > 0 else 0, "grad": count if stage < stages - 1 else 0}


def build_schedule(schedule: str, stages: int, microbatches: int, batches: int,
                   first_batch: int = 0) -> list[list[Action]]:
    return [list(stage_actions(schedule, stages, microbatches, batches, s, first_batch))
            for s in range(stages)]


def forward_only_actions(stages: int, microbatches: int, stage: int) -> Iterator[Action]:
    """Evaluation: forwards of `microbatches` microbatches with the newest weights (version None)."""
    for k in range(microbatches):
        if stage > 0:
            yield Action(RECV_ACT, k)
        yield Action(FORWARD, k)
        if stage < stages - 1:
            yield Action(SEND_ACT, k)


# ---------------------------------------------------------------------------------------------
# Timeline: event-driven replay of all stages' lists with given durations (also a deadlock check)

@dataclass(frozen=True)
class TimedAction:
    stage: int
    action: Action
    start: float
    end: float


def _peer(stage: int, kind: str) -> tuple[int, str]:
    """The stage and kind of the send a receive waits for."""
    return (stage - 1, SEND_ACT) if kind == RECV_ACT else (stage + 1, SEND_GRAD)


def timeline(actions: list[list[Action]], duration: Callable[[int, Action], float] | None = None,
             transfer: Callable[[int, int, Action], float] | None = None) -> list[list[TimedAction]]:
    """Replay every stage's list in order. Sends never block; a receive starts once the matching
    send ended plus `transfer(src, dst, action)`. Raises ScheduleError naming each stuck stage."""
    duration = duration or (lambda stage, a: {FORWARD: 1.0, BACKWARD: 2.0}.get(a.kind, 0.0))
    transfer = transfer or (lambda src, dst, a: 0.0)
    n = len(actions)
    sent: dict[tuple[int, str, int], float] = {}  # (stage, kind, microbatch) -> end time
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
                    src, send_kind = _peer(s, a.kind)
                    key = (src, send_kind, a.microbatch)
                    if key not in sent:
                        break
                    start = max(start, sent.pop(key) + transfer(src, s, a))
                end = start + duration(s, a)
                if a.kind in (SEND_ACT, SEND_GRAD):
                    sent[(s, a.kind, a.microbatch)] = end
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
        (s, kind, k), _ = next(iter(sent.items()))
        raise ScheduleError(f"stage {s}: {kind}({k}) is never received")
    return result


# ---------------------------------------------------------------------------------------------
# Validation

def _fail(stage: int, position: int, action: Action, rule: str):
    raise ScheduleError(f"stage {stage}, action {position} ({action}): {rule}")


def validate(actions: list[list[Action]], schedule: str, microbatches: int,
             first_batch: int = 0) -> None:
    """Check every rule of a pipeline schedule without processes; raise ScheduleError naming the
    stage, the position and the rule if one is broken. Besides the data flow, per stage:
    - weights: every forward and backward names the schedule's version for its batch, a
      microbatch's backward the version of its forward, and only live versions; at most
      live_versions(schedule, p, stage) are live at once (the segment starts with the versions
      its first batches read, up to the newest, first_batch);
    - the gradient buffer: a batch's gradients are reduced before the next batch's first
      backward writes the buffer, after every backward of the batch; a batch's step comes after
      its reduction, and before the next batch's reduction reuses the master gradients;
      every batch of the segment is reduced and stepped by its end."""
    stages = len(actions)
    m = microbatches
    batches = range(first_batch, first_batch + (len(_microbatches(actions)) + m - 1) // m)
    for s, stage_list in enumerate(actions):
        first, last = s == 0, s == stages - 1
        limit = max_in_flight(schedule, stages, m, s)
        version_limit = live_versions(schedule, stages, s)
        forwarded, backwarded, received_act, received_grad = set(), set(), set(), set()
        alive = set(range(version_for_batch(schedule, first_batch, s, stages), first_batch + 1))
        forward_version: dict[int, int] = {}
        reduced: set[int] = set()
        stepped: set[int] = set()
        for i, a in enumerate(stage_list):
            k = a.microbatch
            if a.kind == FORWARD:
                if k in forwarded:
                    _fail(s, i, a, "microbatch forwarded twice")
                if not first and k not in received_act:
                    _fail(s, i, a, "forward before its activation was received from the previous stage")
                forwarded.add(k)
                if len(forwarded) - len(backwarded) > limit:
                    _fail(s, i, a, f"more than {limit} microbatches in flight on stage {s}")
            elif a.kind == BACKWARD:
                if k not in forwarded or k in backwarded:
                    _fail(s, i, a, "backward without a preceding forward, or twice")
                if not last and k not in received_grad:
                    _fail(s, i, a, "backward before its gradient was received from the next stage")
                unreduced = [b for b in range(first_batch, k // m) if b not in reduced]
                if unreduced:
                    _fail(s, i, a, f"gradient buffer: backward of batch {k // m} writes the buffer "
                                   f"before batch {unreduced[0]}'s gradients were reduced")
                backwarded.add(k)
            elif a.kind == RECV_ACT:
                if first:
                    _fail(s, i, a, "the first stage has no previous stage to receive from")
                received_act.add(k)
            elif a.kind == RECV_GRAD:
                if last:
                    _fail(s, i, a, "the last stage has no next stage to receive from")
                received_grad.add(k)
            elif a.kind == SEND_ACT and (last or k not in forwarded):
                _fail(s, i, a, "send of an activation that was not computed (or from the last stage)")
            elif a.kind == SEND_GRAD and (first or k not in backwarded):
                _fail(s, i, a, "send of a gradient that was not computed (or from the first stage)")
            elif a.kind == REDUCE_GRADS:
                batch_ks = range(a.batch * m, (a.batch + 1) * m)
                if not all(x in backwarded for x in batch_ks):
                    _fail(s, i, a, "gradients reduced before every backward of the batch")
                unstepped = [b for b in range(first_batch, a.batch) if b not in stepped]
                if unstepped:
                    _fail(s, i, a, f"gradient buffer: batch {a.batch}'s reduction reuses the "
                                   f"master gradients before batch {unstepped[0]}'s step "
                                   f"consumed them")
                reduced.add(a.batch)
            elif a.kind == STEP:
                if a.batch not in reduced:
                    _fail(s, i, a, "step before the batch's gradients were reduced")
                if a.version != a.batch + 1:
                    _fail(s, i, a, "step of batch b must create version b+1")
                stepped.add(a.batch)
                alive.add(a.version)
            elif a.kind == RELEASE_VERSION:
                if a.version not in alive:
                    _fail(s, i, a, "release of a version that is not alive")
                alive.discard(a.version)
            if a.kind in COMPUTE_KINDS:
                expected = version_for_batch(schedule, k // m, s, stages)
                if a.version != expected:
                    _fail(s, i, a, f"{schedule} must use version {expected} for microbatch {k} "
                                   f"on stage {s}")
                if a.kind == BACKWARD and forward_version.get(k) != a.version:
                    _fail(s, i, a, f"weight stashing: the backward of microbatch {k} names version "
                                   f"{a.version}, its forward version {forward_version.get(k)}")
                forward_version.setdefault(k, a.version)
                if a.version not in alive:
                    _fail(s, i, a, f"version {a.version} is not alive (not created yet or released)")
            if len(alive) > version_limit:
                _fail(s, i, a, f"{schedule} holds {len(alive)} weight versions on stage {s} (at "
                               f"most {version_limit})")
        missing = forwarded - backwarded
        if missing:
            raise ScheduleError(f"stage {s}: microbatches {sorted(missing)} never run backward")
        for b in batches:
            if b not in reduced or b not in stepped:
                raise ScheduleError(f"stage {s}: batch {b} is never "
                                    f"{'reduced' if b not in reduced else 'stepped'}")
    timeline(actions)  # raises on deadlock or an unmatched send


def _microbatches(actions: list[list[Action]]) -> set[int]:
    return {a.microbatch for stage_list in actions for a in stage_list if a.kind == FORWARD}


# ---------------------------------------------------------------------------------------------
# Text picture

def render(actions: list[list[Action]], width: int = 200) -> str:
    """Rank-by-time text grid (forward 1 slot, backward 2 slots): `F3` / `B3` then the version."""
    timed = timeline(actions)
    end = max((t.end for row in timed for t in row), default=0.0)
    columns = min(int(end), width)
    def label(a: Action) -> str:
        return f"{a.kind[0].upper()}{a.microbatch}v{a.version}"
    cell = max([5, *(len(label(t.action)) + 1 for row in timed for t in row
                     if t.action.kind in COMPUTE_KINDS)])  # a space after every label
    lines = []
    for s, row in enumerate(timed):
        grid = ["." * cell] * columns
        for t in row:
            if t.action.kind not in COMPUTE_KINDS or int(t.start) >= columns:
                continue
            for c in range(int(t.start), min(int(t.end), columns)):
                grid[c] = label(t.action).ljust(cell) if c == int(t.start) else "-" * cell
        lines.append(f"stage {s} |" + "".join(grid))
    lines.append("F<k>v<w>: forward of microbatch k with weight version w; B: backward "
                 "(2 slots); '.' idle")
    return "\n".join(lines)
