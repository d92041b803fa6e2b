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
- "pipemare" PipeMare (pipeline/pipemare.py): 2BW's never-drained 1F1B order with ONE weight
          version per stage, stepped right after each batch's reduction: the forward of microbatch
          k reads version max(floor((k - (p-1-s)) / m), first_batch), its backward the newest,
          version k // m (the backward reads the weights at backward time; no stashing).
- "zb-h1" zero bubble (pipeline/zero_bubble.py): 1F1B with each backward split into B (input
          gradient) and W (weight gradient); W passes fill the drain. Vanilla, drained per batch.
- "interleaved" Megatron-LM's interleaved 1F1B (pipeline/interleaved.py): each rank holds `chunks`
          model chunks (virtual stages c*p + r); actions carry their chunk. Vanilla, drained.
A training run is cut into segments (at evaluation and checkpoint points); each segment is one call
with `first_batch` and `batches`, ends drained, and leaves every step of its batches done. The
weight-version rule depends only on batch indices, so segmenting never changes the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

FORWARD, BACKWARD = "forward", "backward"
# the split backward (zero-bubble schedules): input gradient first, weight gradient later
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"
REDUCE_GRADS, STEP, RELEASE_VERSION = "reduce_grads", "step", "release_version"
COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
LETTERS = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}
COMM_KINDS = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)
SCHEDULES = ("2bw", "flush", "gpipe", "pipedream", "pipedream-vs", "pipemare", "zb-h1",
             "interleaved")
# one 1F1B sequence over every batch of a segment (PipeMare's steps as soon as the gradients are
# reduced, the others' deferred until their version is needed)
NEVER_DRAINED = ("2bw", "pipedream", "pipedream-vs", "pipemare")


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int | None = None  # global index k = batch * m + j
    version: int | None = None  # used (forward/backward), created (step) or freed (release)
    batch: int | None = None  # for reduce_grads and step
    chunk: int = 0  # the rank's model chunk (interleaved: virtual stage chunk * p + rank)

    def __str__(self) -> str:
        chunk = f"/c{self.chunk}" if self.chunk else ""
        if self.kind in COMPUTE_KINDS:
            return f"{LETTERS[self.kind]}{self.microbatch}{chunk}@v{self.version}"
        if self.kind in COMM_KINDS:
            return f"{self.kind}({self.microbatch}{chunk})"
        if self.kind == RELEASE_VERSION:
            return f"release(v{self.version})"
        return f"{self.kind}(b{self.batch}->v{self.version})" if self.kind == STEP else \
            f"{self.kind}(b{self.batch})"


class ScheduleError(ValueError):
    """An action list breaks a rule; the message names the stage, position and rule."""


def update_delay(schedule: str, stage: int = 0, stages: int = 1) -> int:
    """How many updates behind the newest weights a stage's batches run: batch b reads version
    max(0, b - delay) (PipeMare: its backwards; its forwards, pipemare.forward_version)."""
    if schedule == "2bw":
        return 1
    if schedule == "pipedream":
        return stages - 1 - stage
    if schedule == "pipedream-vs":
        return stages - 1
    return 0


def version_for_batch(schedule: str, batch: int, stage: int = 0, stages: int = 1) -> int:
    """The weight version batch `batch` reads on `stage` of `stages` (forward and backward alike;
    PipeMare: the backward)."""
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
        plain PipeDream and PipeMare, whose later stages need a new version before the first
        stage's gradient of that update exists."""
        return self.schedule not in ("pipedream", "pipemare") or self.stages == 1


def max_in_flight(schedule: str, stages: int, microbatches: int, stage: int,
                  chunks: int = 1) -> int:
    """Microbatches whose activations a stage holds at once (interleaved: microbatch-chunks, each
    holding 1/chunks of the stage's layers; zb-h1: from forward to weight gradient)."""
    if schedule == "interleaved":
        return min(interleaved.warmup_forwards(stages, microbatches, stage, chunks) + 1, microbatches * chunks)
    if schedule == "zb-h1":
        return min(stages, microbatches)
    return microbatches if schedule == "gpipe" else min(stages - stage, microbatches) \
        if schedule == "flush" else stages - stage


def _check_args(schedule: str, stages: int, microbatches: int, batches: int, stage: int,
                chunks: int = 1):
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
    if stages < 1 or microbatches < 1 or batches < 0 or not 0 <= stage < stages:
        raise ValueError(f"bad schedule shape: stages={stages} microbatches={microbatches} "
                         f"batches={batches} stage={stage}")
    if schedule in ("2bw", "flush", "zb-h1") and microbatches < stages:
        raise ValueError(f"{schedule} needs microbatches per batch >= stages (1F1B keeps up to p "
                         f"microbatches in flight): got m={microbatches} < p={stages}")
    if chunks < 1 or (chunks > 1 and schedule != "interleaved"):
        raise ValueError(f"{schedule} runs one model chunk per stage, got chunks={chunks}")
    if schedule == "interleaved" and microbatches % stages:
        raise ValueError(f"interleaved needs microbatches per batch a multiple of stages (the "
                         f"chunks take microbatches in groups of p): got m={microbatches}, "
                         f"p={stages}")


def stage_actions(schedule: str, stages: int, microbatches: int, batches: int, stage: int,
                  first_batch: int = 0, chunks: int = 1) -> Iterator[Action]:
    """The ordered actions of one stage for batches first_batch .. first_batch+batches-1 (lazy)."""
    _check_args(schedule, stages, microbatches, batches, stage, chunks)
    if schedule in FLUSHED_GENERATORS:
        yield from FLUSHED_GENERATORS[schedule](stages, microbatches, batches, stage, first_batch,
                                                chunks)
        return
    first, last = stage == 0, stage == stages - 1
    m = microbatches
    end_batch = first_batch + batches
    pending_steps: list[int] = []  # never-drained schedules: batches whose step is deferred
    never_drained = schedule in NEVER_DRAINED
    deferred = never_drained and schedule != "pipemare"

    def version_of_batch(b: int) -> int:
        return version_for_batch(schedule, b, stage, stages)

    def version(k: int) -> int:
        return version_of_batch(k // m)

    def forward_version(k: int) -> int:
        if schedule == "pipemare":
            return pipemare.forward_version(k, m, stage, stages, first_batch)
        return version(k)

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
        yield Action(FORWARD, k, forward_version(k))
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

    if never_drained:
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


def stage_receives(stages: int, microbatches: int, batches: int, stage: int,
                   chunks: int = 1) -> dict[str, int]:
    """How many activations ("act") and gradients ("grad") the stage receives over `batches`
    batches, in every schedule: one of each per microbatch and chunk, except at the ends of the
    (virtual) pipeline."""
    count = microbatches * batches
    return {"act": count * (chunks if stage > 0 else chunks - 1),
            "grad": count * (chunks if stage < stages - 1 else chunks - 1)}


def build_schedule(schedule: str, stages: int, microbatches: int, batches: int,
                   first_batch: int = 0, chunks: int = 1) -> list[list[Action]]:
    return [list(stage_actions(schedule, stages, microbatches, batches, s, first_batch, chunks))
            for s in range(stages)]


def forward_only_actions(stages: int, microbatches: int, stage: int,
                         chunks: int = 1) -> Iterator[Action]:
    """Evaluation: forwards of `microbatches` microbatches with the newest weights (version None);
    with chunks, in the interleaved order (microbatches in groups of p through each chunk)."""
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


def transfer_actions(kind: str, stages: int, stage: int, chunks: int, k: int, chunk: int,
                     version: int) -> tuple[list[Action], Action, list[Action]]:
    """A compute action with the receive before it and the send after it where the virtual
    pipeline (chunk c of stage r is virtual stage c * p + r) has a neighbour on that side."""
    first = stage == 0 and chunk == 0
    last = stage == stages - 1 and chunk == chunks - 1
    compute = Action(kind, k, version, chunk=chunk)
    if kind == FORWARD:
        return ([] if first else [Action(RECV_ACT, k, chunk=chunk)], compute,
                [] if last else [Action(SEND_ACT, k, chunk=chunk)])
    if kind == BACKWARD_WEIGHT:
        return [], compute, []
    return ([] if last else [Action(RECV_GRAD, k, chunk=chunk)], compute,
            [] if first else [Action(SEND_GRAD, k, chunk=chunk)])


def end_of_flushed_batch(batch: int) -> list[Action]:
    """Vanilla schedules: reduce, release and step once the batch's last backward is done."""
    return [Action(REDUCE_GRADS, batch=batch), Action(RELEASE_VERSION, version=batch),
            Action(STEP, version=batch + 1, batch=batch)]


# ---------------------------------------------------------------------------------------------
# Timeline: event-driven replay of all stages' lists with given durations (also a deadlock check)

# a backward split into B and W takes about what the whole backward takes (F 1, B + W 2)
DEFAULT_DURATIONS = {FORWARD: 1.0, BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0}


@dataclass(frozen=True)
class TimedAction:
    stage: int
    action: Action
    start: float
    end: float


def _peer(stage: int, kind: str, chunk: int = 0, stages: int = 0) -> tuple[int, str, int]:
    """The stage, kind and chunk of the send a receive waits for (chunks: the virtual pipeline
    wraps from the last stage's chunk c to the first stage's chunk c + 1)."""
    if kind == RECV_ACT:
        return (stage - 1) % max(stages, 1), SEND_ACT, chunk - (stage == 0)
    return (stage + 1) % max(stages, 1), SEND_GRAD, chunk + (stage == stages - 1)


def timeline(actions: list[list[Action]], duration: Callable[[int, Action], float] | None = None,
             transfer: Callable[[int, int, Action], float] | None = None) -> list[list[TimedAction]]:
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
                    src, send_kind, chunk = _peer(s, a.kind, a.chunk, n)
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
    chunks = 1 + max((a.chunk for row in actions for a in row), default=0)
    for s, stage_list in enumerate(actions):
        limit = max_in_flight(schedule, stages, m, s, chunks)
        version_limit = live_versions(schedule, stages, s)
        # sets of (chunk, microbatch); `freed`: activations dropped (backward, or W after B)
        forwarded, backwarded, received_act, received_grad = set(), set(), set(), set()
        weighted, freed = set(), set()
        alive = set(range(version_for_batch(schedule, first_batch, s, stages), first_batch + 1))
        forward_version: dict[tuple[int, int], int] = {}
        reduced: set[int] = set()
        stepped: set[int] = set()
        for i, a in enumerate(stage_list):
            k = a.microbatch
            first = s == 0 and a.chunk == 0  # of the virtual pipeline
            last = s == stages - 1 and a.chunk == chunks - 1
            key = (a.chunk, k)
            if a.kind == FORWARD:
                if key in forwarded:
                    _fail(s, i, a, "microbatch forwarded twice")
                if not first and key not in received_act:
                    _fail(s, i, a, "forward before its activation was received from the previous stage")
                forwarded.add(key)
                if len(forwarded) - len(freed) > limit:
                    _fail(s, i, a, f"more than {limit} microbatches in flight on stage {s}")
            elif a.kind in (BACKWARD, BACKWARD_INPUT):
                if key not in forwarded or key in backwarded:
                    _fail(s, i, a, "backward without a preceding forward, or twice")
                if not last and key not in received_grad:
                    _fail(s, i, a, "backward before its gradient was received from the next stage")
                unreduced = [b for b in range(first_batch, k // m) if b not in reduced]
                if unreduced:
                    _fail(s, i, a, f"gradient buffer: backward of batch {k // m} writes the buffer "
                                   f"before batch {unreduced[0]}'s gradients were reduced")
                backwarded.add(key)
                if a.kind == BACKWARD:
                    freed.add(key)
            elif a.kind == BACKWARD_WEIGHT:
                if key not in backwarded or key in weighted or key in freed:
                    _fail(s, i, a, "weight gradient without a preceding input gradient (B), or "
                                   "twice")
                weighted.add(key)
                freed.add(key)
            elif a.kind == RECV_ACT:
                if first:
                    _fail(s, i, a, "the first stage has no previous stage to receive from")
                received_act.add(key)
            elif a.kind == RECV_GRAD:
                if last:
                    _fail(s, i, a, "the last stage has no next stage to receive from")
                received_grad.add(key)
            elif a.kind == SEND_ACT and (last or key not in forwarded):
                _fail(s, i, a, "send of an activation that was not computed (or from the last stage)")
            elif a.kind == SEND_GRAD and (first or key not in backwarded):
                _fail(s, i, a, "send of a gradient that was not computed (or from the first stage)")
            elif a.kind == REDUCE_GRADS:
                batch_ks = range(a.batch * m, (a.batch + 1) * m)
                if not all((c, x) in freed for c in range(chunks) for x in batch_ks):
                    _fail(s, i, a, "gradients reduced before every backward (and weight gradient) "
                                   "of the batch")
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
                if schedule == "pipemare" and a.kind == FORWARD:
                    expected = pipemare.forward_version(k, m, s, stages, first_batch)
                if a.version != expected:
                    _fail(s, i, a, f"{schedule} must use version {expected} for microbatch {k} "
                                   f"on stage {s}")
                if a.kind != FORWARD and forward_version.get(key) != a.version and \
                        schedule != "pipemare":  # PipeMare's backward reads the newest
                    _fail(s, i, a, f"weight stashing: the backward of microbatch {k} names version "
                                   f"{a.version}, its forward version {forward_version.get(key)}")
                forward_version.setdefault(key, a.version)
                if a.version not in alive:
                    _fail(s, i, a, f"version {a.version} is not alive (not created yet or released)")
            if len(alive) > version_limit:
                _fail(s, i, a, f"{schedule} holds {len(alive)} weight versions on stage {s} (at "
                               f"most {version_limit})")
        missing = forwarded - freed
        if missing:
            raise ScheduleError(f"stage {s}: (chunk, microbatch) {sorted(missing)} never run "
                                f"backward (or their weight gradient)")
        for b in batches:
            if b not in reduced or b not in stepped:
                raise ScheduleError(f"stage {s}: batch {b} is never "
                                    f"{'reduced' if b not in reduced else 'stepped'}")
    _check_transfer_order(actions)
    timeline(actions)  # raises on deadlock or an unmatched send


def _microbatches(actions: list[list[Action]]) -> set[int]:
    return {a.microbatch for stage_list in actions for a in stage_list if a.kind == FORWARD}

def _check_transfer_order(actions: list[list[Action]]) -> None:
    """Transfers carry no microbatch number: from one stage to another, the receives must come in
    the order of the sends they match, both kinds together (under interleaving at p = 2 a rank
    pair carries both, and NCCL matches a pair's transfers in posting order, tags aside)."""
    stages = len(actions)
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for s, stage_list in enumerate(actions):
        for a in stage_list:
            if a.kind in (SEND_ACT, SEND_GRAD):
                dst = (s + 1 if a.kind == SEND_ACT else s - 1) % stages
                sent.setdefault((s, dst), []).append((a.kind, a.microbatch, a.chunk))
            elif a.kind in (RECV_ACT, RECV_GRAD):
                src, kind, chunk = _peer(s, a.kind, a.chunk, stages)
                received.setdefault((src, s), []).append((kind, a.microbatch, chunk))
    for (src, dst), order in received.items():
        if sent.get((src, dst), []) != order:
            raise ScheduleError(f"stage {dst} receives its transfers from stage {src} in another "
                                f"order than stage {src} sends them")


# ---------------------------------------------------------------------------------------------
# Text picture

def render(actions: list[list[Action]], width: int = 200) -> str:
    """Rank-by-time text grid (forward 1 slot, backward 2 slots): `F3` / `B3` then the version."""
    timed = timeline(actions)
    end = max((t.end for row in timed for t in row), default=0.0)
    columns = min(int(end), width)
    chunked = any(t.action.chunk for row in timed for t in row)

    def label(a: Action) -> str:
        chunk = f".{a.chunk}" if chunked else ""
        return f"{LETTERS[a.kind]}{a.microbatch}{chunk}v{a.version}"
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
    split = any(t.action.kind == BACKWARD_WEIGHT for row in timed for t in row)
    lines.append("F<k>v<w>: forward of microbatch k with weight version w; B: backward "
                 + ("input gradient, W: weight gradient (1 slot each); " if split else "(2 slots); ")
                 + ("<k>.<c>: chunk c; " if chunked else "") + "'.' idle")
    return "\n".join(lines)


# the vanilla schedules that live in their own modules (they build on the helpers above)
from megatron_2bw.pipeline import interleaved, pipemare, zero_bubble  # noqa: E402

FLUSHED_GENERATORS = {"zb-h1": zero_bubble.zb_h1_actions,
                      "interleaved": interleaved.interleaved_actions}
