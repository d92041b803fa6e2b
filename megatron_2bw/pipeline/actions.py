"""The action vocabulary of pipeline schedules: what one stage does, in order.

A schedule is a list of actions per stage (forward or backward of microbatch k with weight version
v, sends and receives, gradient reduction, the optimizer step that creates a version, version
release). The executor runs them, the validator checks them, the replay times them and the
pictures draw them: each generator in this package yields these and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

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
                   version: int) -> Iterator[Action]:
    """A compute action with the receive before it and the send after it where the virtual
    pipeline (chunk c of stage r is virtual stage c * p + r) has a neighbour on that side."""
    first = stage == 0 and chunk == 0
    last = stage == stages - 1 and chunk == chunks - 1
    if kind == FORWARD and not first:
        yield Action(RECV_ACT, k, chunk=chunk)
    if kind in (BACKWARD, BACKWARD_INPUT) and not last:
        yield Action(RECV_GRAD, k, chunk=chunk)
    yield Action(kind, k, version, chunk=chunk)
    if kind == FORWARD and not last:
        yield Action(SEND_ACT, k, chunk=chunk)
    if kind in (BACKWARD, BACKWARD_INPUT) and not first:
        yield Action(SEND_GRAD, k, chunk=chunk)


def end_of_flushed_batch(batch: int) -> list[Action]:
    """Vanilla schedules: reduce, release and step once the batch's last backward is done."""
    return [Action(REDUCE_GRADS, batch=batch), Action(RELEASE_VERSION, version=batch),
            Action(STEP, version=batch + 1, batch=batch)]


def transfer_peer(stage: int, kind: str, chunk: int = 0, stages: int = 0) -> tuple[int, str, int]:
    """The stage, kind and chunk of the send a receive waits for (chunks: the virtual pipeline
    wraps from the last stage's chunk c to the first stage's chunk c + 1)."""
    if kind == RECV_ACT:
        return (stage - 1) % max(stages, 1), SEND_ACT, chunk - (stage == 0)
    return (stage + 1) % max(stages, 1), SEND_GRAD, chunk + (stage == stages - 1)


def send_destination(stage: int, kind: str, stages: int) -> int:
    """The stage a send goes to: activations to the next stage, gradients to the previous one."""
    return (stage + 1 if kind == SEND_ACT else stage - 1) % stages


def stage_receives(stages: int, microbatches: int, batches: int, stage: int,
                   chunks: int = 1) -> dict[str, int]:
    """How many activations ("act") and gradients ("grad") the stage receives over `batches`
    batches, in every schedule: one of each per microbatch and chunk, except at the ends of the
    (virtual) pipeline."""
    count = microbatches * batches
    return {"act": count * (chunks if stage > 0 else chunks - 1),
            "grad": count * (chunks if stage < stages - 1 else chunks - 1)}
