"""Every pipeline schedule by name: its generator of per-stage action lists and its shape rules.

A schedule is one generator, (stages, microbatches, batches, stage, first_batch, chunks) ->
actions, in its own module, and one entry here. The executor, the validator, the planner's
simulator and the pictures all read the lists it yields.

A training run is cut into segments (at evaluation and checkpoint points); each segment is one
call with `first_batch` and `batches`, ends drained, and leaves every step of its batches done. The
weight-version rule depends only on batch indices, so segmenting never changes the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from megatron_2bw.pipeline import dualpipe_v, interleaved, one_f_one_b, zb_v, zero_bubble
from megatron_2bw.pipeline.actions import BACKWARD, BACKWARD_WEIGHT, FORWARD, Action
from megatron_2bw.pipeline.gpipe import gpipe_actions


def _one_f_one_b_in_flight(stages: int, microbatches: int, stage: int, chunks: int) -> int:
    return stages - stage


def _counted_in_flight(order: Callable[[int, int, int], list[tuple[str, int, int]]]):
    """In-flight microbatch-chunks of a schedule given as one batch's order, counted from it:
    a pass's activations live from its forward to its full backward or weight gradient."""
    def in_flight(stages: int, microbatches: int, stage: int, chunks: int) -> int:
        held = peak = 0
        for kind, _, _ in order(stages, microbatches, stage):
            held += kind == FORWARD
            held -= kind in (BACKWARD, BACKWARD_WEIGHT)
            peak = max(peak, held)
        return peak
    return in_flight


@dataclass(frozen=True)
class ScheduleSpec:
    generator: Callable[..., Iterator[Action]]
    # microbatches whose activations a stage holds at once: (stages, microbatches, stage, chunks)
    in_flight: Callable[[int, int, int, int], int] = _one_f_one_b_in_flight
    never_drained: bool = False  # one sequence over every batch of a segment
    # the fewest microbatches per batch, given p, and why
    min_microbatches: Callable[[int], int] = lambda stages: 1
    min_microbatches_reason: str = ""
    microbatches_multiple_of_stages: bool = False
    chunks: int | None = 1  # model chunks per rank (None: two or more, as the user sets)
    shape: str = "loop"  # where the chunks sit (placement.py)


_ONE_F_ONE_B_MIN = dict(min_microbatches=lambda p: p, min_microbatches_reason=(
    "1F1B keeps up to p microbatches in flight"))
REGISTRY: dict[str, ScheduleSpec] = {
    "2bw": ScheduleSpec(one_f_one_b.two_bw_actions, never_drained=True, **_ONE_F_ONE_B_MIN),
    "flush": ScheduleSpec(one_f_one_b.flush_actions, in_flight=lambda p, m, r, v: min(p - r, m),
                          **_ONE_F_ONE_B_MIN),
    "gpipe": ScheduleSpec(gpipe_actions, in_flight=lambda p, m, r, v: m),
    "pipedream": ScheduleSpec(one_f_one_b.pipedream_actions, never_drained=True),
    "pipedream-vs": ScheduleSpec(one_f_one_b.pipedream_vs_actions, never_drained=True),
    "pipemare": ScheduleSpec(one_f_one_b.pipemare_actions, never_drained=True),
    # activations live from the forward to the weight gradient: p on every stage
    "zb-h1": ScheduleSpec(zero_bubble.zb_h1_actions, in_flight=lambda p, m, r, v: min(p, m),
                          **_ONE_F_ONE_B_MIN),
    # microbatch-chunks, each holding 1/v of the stage's layers
    "interleaved": ScheduleSpec(
        interleaved.interleaved_actions, microbatches_multiple_of_stages=True, chunks=None,
        in_flight=lambda p, m, r, v: min(interleaved.warmup_forwards(p, m, r, v) + 1, m * v)),
    "zb-v": ScheduleSpec(zb_v.zb_v_actions, chunks=2, shape="v",
                         in_flight=_counted_in_flight(zb_v.zb_v_order)),
    "dualpipev": ScheduleSpec(dualpipe_v.dualpipe_v_actions, chunks=2, shape="v",
                              in_flight=_counted_in_flight(dualpipe_v.dualpipe_v_order),
                              min_microbatches=lambda p: 2 * p, min_microbatches_reason=(
                                  "its steady state pairs forwards and backwards of 2p "
                                  "microbatches in flight")),
}
SCHEDULES = tuple(REGISTRY)
NEVER_DRAINED = tuple(name for name, spec in REGISTRY.items() if spec.never_drained)


def max_in_flight(schedule: str, stages: int, microbatches: int, stage: int,
                  chunks: int = 1) -> int:
    """Microbatches whose activations a stage holds at once (interleaved: microbatch-chunks, each
    holding 1/chunks of the stage's layers; zb-h1: from forward to weight gradient)."""
    return REGISTRY[schedule].in_flight(stages, microbatches, stage, chunks)


def check_shape(schedule: str, stages: int, microbatches: int, batches: int, stage: int,
                chunks: int = 1) -> None:
    if schedule not in REGISTRY:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
    spec = REGISTRY[schedule]
    if stages < 1 or microbatches < 1 or batches < 0 or not 0 <= stage < stages:
        raise ValueError(f"bad schedule shape: stages={stages} microbatches={microbatches} "
                         f"batches={batches} stage={stage}")
    least = spec.min_microbatches(stages)
    if microbatches < least:
        bound, value = ("stages", f"p={stages}") if least == stages else \
            (f"{least // stages} x stages", f"{least // stages}p={least}")
        raise ValueError(f"{schedule} needs microbatches per batch >= {bound} "
                         f"({spec.min_microbatches_reason}): got m={microbatches} < {value}")
    if spec.chunks is None and chunks < 1 or spec.chunks is not None and chunks != spec.chunks:
        held = "one model chunk" if spec.chunks == 1 else f"{spec.chunks} model chunks"
        raise ValueError(f"{schedule} runs {held} per stage, got chunks={chunks}")
    if spec.microbatches_multiple_of_stages and microbatches % stages:
        raise ValueError(f"{schedule} needs microbatches per batch a multiple of stages (the "
                         f"chunks take microbatches in groups of p): got m={microbatches}, "
                         f"p={stages}")


def stage_actions(schedule: str, stages: int, microbatches: int, batches: int, stage: int,
                  first_batch: int = 0, chunks: int = 1) -> Iterator[Action]:
    """The ordered actions of one stage for batches first_batch .. first_batch+batches-1 (lazy)."""
    check_shape(schedule, stages, microbatches, batches, stage, chunks)
    return REGISTRY[schedule].generator(stages, microbatches, batches, stage, first_batch, chunks)


def build_schedule(schedule: str, stages: int, microbatches: int, batches: int,
                   first_batch: int = 0, chunks: int = 1) -> list[list[Action]]:
    return [list(stage_actions(schedule, stages, microbatches, batches, s, first_batch, chunks))
            for s in range(stages)]
