"""The action vocabulary of pipeline schedules: what one stage does, in order.

A schedule is a list of actions per stage (forward or backward of microbatch k with weight version
v, sends and receives, gradient reduction, the optimizer step that creates a version, version
release). The executor runs them, the validator checks them, the replay times them and the
pictures draw them: each generator in this package yields these and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from megatron_2bw.pipeline.placement import Placement

FORWARD, BACKWARD = "forward", "backward"
# the split backward (zero-bubble schedules): input gradient first, weight gradient later
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"
REDUCE_GRADS, STEP, RELEASE_VERSION = "reduce_grads", "step", "release_version"
COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
LETTERS = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}
COMM_KINDS = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)


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


def with_transfers(kind: str, stages: int, stage: int, chunks: int, k: int, chunk: int,
                   version: int, shape: str = "loop") -> Iterator[Action]:
    """A compute action with the receive before it and the send after it where the virtual
    pipeline has a neighbour on another rank on that side (placement.py: a V's turn on the last
    rank is a local hand-off, no transfer)."""
    placement = Placement(stages, chunks, shape)
    before, after = placement.previous(stage, chunk), placement.next(stage, chunk)
    to_previous = before is not None and not placement.is_local(stage, before)
    to_next = after is not None and not placement.is_local(stage, after)
    if kind == FORWARD and to_previous:
        yield Action(RECV_ACT, k, chunk=chunk)
    if kind in (BACKWARD, BACKWARD_INPUT) and to_next:
        yield Action(RECV_GRAD, k, chunk=chunk)
    yield Action(kind, k, version, chunk=chunk)
    if kind == FORWARD and to_next:
        yield Action(SEND_ACT, k, chunk=chunk)
    if kind in (BACKWARD, BACKWARD_INPUT) and to_previous:
        yield Action(SEND_GRAD, k, chunk=chunk)


def end_of_flushed_batch(batch: int) -> list[Action]:
    """Vanilla schedules: reduce, release and step once the batch's last backward is done."""
    return [Action(REDUCE_GRADS, batch=batch), Action(RELEASE_VERSION, version=batch),
            Action(STEP, version=batch + 1, batch=batch)]


def flushed_batches(order: list[tuple[str, int, int]], stages: int, stage: int, chunks: int,
                    microbatches: int, batches: int, first_batch: int,
                    shape: str = "loop") -> Iterator[Action]:
    """A vanilla schedule's actions: per batch, the stage's `order` of (kind, chunk, j) passes (j:
    the microbatch's index in the batch) with their transfers, then the reduce and the step."""
    for b in range(first_batch, first_batch + batches):
        for kind, chunk, j in order:
            yield from with_transfers(kind, stages, stage, chunks, b * microbatches + j, chunk, b,
                                      shape)
        yield from end_of_flushed_batch(b)


def aligned_flushed_batches(order_of_stage, stages: int, stage: int, chunks: int,
                            microbatches: int, batches: int, first_batch: int,
                            shape: str = "loop") -> Iterator[Action]:
    """flushed_batches with every receive in its sender's order (receives_in_send_order): for
    schedules whose ranks exchange several kinds of transfer in orders of their own (the V's)."""
    for b in range(first_batch, first_batch + batches):
        rows = [list(flushed_batches(order_of_stage(s), stages, s, chunks, microbatches, 1, b,
                                     shape)) for s in range(stages)]
        yield from receives_in_send_order(rows, shape)[stage]


def receives_in_send_order(actions: list[list[Action]], shape: str = "loop") -> list[list[Action]]:
    """Every stage's list with each receive moved up, where needed, behind the receives of what
    its peer sent earlier: NCCL matches a pair's transfers in posting order whatever their tags,
    so a stage must receive from a peer in the order the peer sends (a V's rank pair carries
    chunk 0's activations one way and chunk 1's the other, and its gradients both ways). A
    receive posted early only holds its buffer longer."""
    stages = len(actions)
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for s, row in enumerate(actions):
        for a in row:
            if a.kind in (SEND_ACT, SEND_GRAD):
                dst = send_destination(s, a.kind, stages, a.chunk, shape)
                sent.setdefault((s, dst), []).append((a.kind, a.microbatch, a.chunk))
    receive_kind = {SEND_ACT: RECV_ACT, SEND_GRAD: RECV_GRAD}
    result = []
    for s, row in enumerate(actions):
        received: set[tuple[int, str, int, int]] = set()
        position: dict[int, int] = {}  # source -> how many of its sends are received
        aligned = []
        for a in row:
            if a.kind in (RECV_ACT, RECV_GRAD):
                if (a.kind, a.microbatch, a.chunk) in received:
                    continue
                source, send_kind, chunk = transfer_peer(s, a.kind, a.chunk, stages, shape)
                order = sent.get((source, s), [])
                target = order.index((send_kind, a.microbatch, chunk))
                for kind, k, c in order[position.get(source, 0):target + 1]:
                    own_chunk = transfer_chunk(s, receive_kind[kind], source, c, stages, shape)
                    aligned.append(Action(receive_kind[kind], k, chunk=own_chunk))
                    received.add((receive_kind[kind], k, own_chunk))
                position[source] = max(position.get(source, 0), target + 1)
                continue
            aligned.append(a)
        result.append(aligned)
    return result


def transfer_chunk(stage: int, kind: str, source: int, source_chunk: int, stages: int,
                   shape: str = "loop") -> int:
    """The chunk of `stage` that receives (kind RECV_ACT or RECV_GRAD) what chunk `source_chunk`
    of `source` sends."""
    placement = _neighbours(stages, shape)
    v = placement.virtual_stage(source, source_chunk)
    return placement.position(v + 1 if kind == RECV_ACT else v - 1)[1]


def transfer_peer(stage: int, kind: str, chunk: int = 0, stages: int = 1,
                  shape: str = "loop") -> tuple[int, str, int]:
    """The stage, kind and chunk of the send a receive waits for (loop placement: the virtual
    pipeline wraps from the last stage's chunk c to the first stage's chunk c + 1)."""
    placement = _neighbours(stages, shape)
    v = placement.virtual_stage(stage, chunk)
    if kind == RECV_ACT:
        source, source_chunk = placement.position(v - 1)
        return source, SEND_ACT, source_chunk
    source, source_chunk = placement.position(v + 1)
    return source, SEND_GRAD, source_chunk


def send_destination(stage: int, kind: str, stages: int, chunk: int = 0,
                     shape: str = "loop") -> int:
    """The rank a send goes to: activations to the next virtual stage, gradients to the
    previous one."""
    placement = _neighbours(stages, shape)
    v = placement.virtual_stage(stage, chunk)
    return placement.position(v + 1 if kind == SEND_ACT else v - 1)[0]


def _neighbours(stages: int, shape: str) -> Placement:
    """A placement for finding neighbours: a loop's positions do not depend on its chunk count."""
    return Placement(stages, 2, shape)


def stage_receives(stages: int, microbatches: int, batches: int, stage: int,
                   chunks: int = 1, shape: str = "loop") -> dict[str, int]:
    """How many activations ("act") and gradients ("grad") the stage receives over `batches`
    batches, in every schedule: one of each per microbatch and chunk, except at the ends of the
    (virtual) pipeline and at a V's turn."""
    count = microbatches * batches
    if shape == "v":  # each from the rank below and the rank above, where there is one
        neighbours = (stage > 0) + (stage < stages - 1)
        return {"act": count * neighbours, "grad": count * neighbours}
    return {"act": count * (chunks if stage > 0 else chunks - 1),
            "grad": count * (chunks if stage < stages - 1 else chunks - 1)}
