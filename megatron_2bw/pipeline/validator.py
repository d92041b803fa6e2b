"""Checks every rule of a pipeline schedule's action lists without processes; a broken rule
raises ScheduleError naming the stage, the position and the rule."""
from __future__ import annotations

from megatron_2bw.pipeline import pipemare
from megatron_2bw.pipeline.actions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT,
                                           COMPUTE_KINDS, FORWARD, RECV_ACT, RECV_GRAD,
                                           REDUCE_GRADS, RELEASE_VERSION, SEND_ACT, SEND_GRAD, STEP,
                                           Action, ScheduleError, send_destination, transfer_peer)
from megatron_2bw.pipeline.placement import Placement
from megatron_2bw.pipeline.replay import timeline
from megatron_2bw.pipeline.schedule_registry import REGISTRY, max_in_flight
from megatron_2bw.pipeline.version_rules import live_versions, version_for_batch


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
    shape = REGISTRY[schedule].shape if schedule in REGISTRY else "loop"
    placement = Placement(stages, chunks, shape)
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
            first = placement.is_first(s, a.chunk)  # of the virtual pipeline
            last = placement.is_last(s, a.chunk)
            before, after = placement.previous(s, a.chunk), placement.next(s, a.chunk)
            # the V's turn: the neighbour chunk on this rank hands over without a transfer
            local_before, local_after = placement.is_local(s, before), placement.is_local(s, after)
            key = (a.chunk, k)
            if a.kind == FORWARD:
                if key in forwarded:
                    _fail(s, i, a, "microbatch forwarded twice")
                if local_before and (before[1], k) not in forwarded:
                    _fail(s, i, a, "forward before the rank's previous chunk computed its input")
                if not first and not local_before and key not in received_act:
                    _fail(s, i, a, "forward before its activation was received from the previous stage")
                forwarded.add(key)
                if len(forwarded) - len(freed) > limit:
                    _fail(s, i, a, f"more than {limit} microbatches in flight on stage {s}")
            elif a.kind in (BACKWARD, BACKWARD_INPUT):
                if key not in forwarded or key in backwarded:
                    _fail(s, i, a, "backward without a preceding forward, or twice")
                if local_after and (after[1], k) not in backwarded:
                    _fail(s, i, a, "backward before the rank's next chunk computed its gradient")
                if not last and not local_after and key not in received_grad:
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
                if first or local_before:
                    _fail(s, i, a, "the first stage has no previous stage to receive from")
                received_act.add(key)
            elif a.kind == RECV_GRAD:
                if last or local_after:
                    _fail(s, i, a, "the last stage has no next stage to receive from")
                received_grad.add(key)
            elif a.kind == SEND_ACT and (last or local_after or key not in forwarded):
                _fail(s, i, a, "send of an activation that was not computed (or from the last stage)")
            elif a.kind == SEND_GRAD and (first or local_before or key not in backwarded):
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
    _check_transfer_order(actions, shape)
    timeline(actions, shape=shape)  # raises on deadlock or an unmatched send


def _microbatches(actions: list[list[Action]]) -> set[int]:
    return {a.microbatch for stage_list in actions for a in stage_list if a.kind == FORWARD}


def _check_transfer_order(actions: list[list[Action]], shape: str = "loop") -> None:
    """Transfers carry no microbatch number: from one stage to another, the receives must come in
    the order of the sends they match, both kinds together (under interleaving at p = 2 a rank
    pair carries both, and NCCL matches a pair's transfers in posting order, tags aside)."""
    stages = len(actions)
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for s, stage_list in enumerate(actions):
        for a in stage_list:
            if a.kind in (SEND_ACT, SEND_GRAD):
                dst = send_destination(s, a.kind, stages, a.chunk, shape)
                sent.setdefault((s, dst), []).append((a.kind, a.microbatch, a.chunk))
            elif a.kind in (RECV_ACT, RECV_GRAD):
                src, kind, chunk = transfer_peer(s, a.kind, a.chunk, stages, shape)
                received.setdefault((src, s), []).append((kind, a.microbatch, chunk))
    for (src, dst), order in received.items():
        if sent.get((src, dst), []) != order:
            raise ScheduleError(f"stage {dst} receives its transfers from stage {src} in another "
                                f"order than stage {src} sends them")
