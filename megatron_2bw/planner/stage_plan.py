"""A layer split and a per-stage recompute plan chosen together (vPipe's plans).

Each stage recomputes the fewest of its layers (its first ones, Megatron's "block" method) that let
it fit in memory; among the contiguous splits, the one whose slowest stage is fastest. A stage's
time per microbatch is its layers' forward and backward, a forward more for each recomputed layer,
plus the embedding (first stage) or the head (last stage). Memory decides only through
`fewest_recomputed(stage, layers)`, so the same search serves the planner (uniform layers, costs
from the profile, memory from the estimator) and online repartitioning (pipeline/repartition.py:
each layer's measured times, which may differ from layer to layer).

Among splits with the same slowest stage the later stages get the most layers: the earlier ones
hold more microbatches in flight (1F1B), hence more activations.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

from megatron_2bw.config import ModelConfig, ParallelConfig, PrecisionConfig, RecomputeConfig

# (stage, layers) -> the fewest of those layers that must recompute for the stage to fit, or None
# when even recomputing all of them does not fit
FewestRecomputed = Callable[[int, int], "int | None"]


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per microbatch of every layer of the model, in order, and of the stage extras."""
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]  # without recomputation
    recompute_s: tuple[float, ...]  # what recomputing the layer adds to its backward
    first_extra_s: float = 0.0  # the embedding's forward and backward (first stage)
    last_extra_s: float = 0.0  # the head's forward and backward (last stage)

    @classmethod
    def uniform(cls, layers: int, forward_s: float, backward_s: float, recompute_s: float,
                first_extra_s: float = 0.0, last_extra_s: float = 0.0) -> "LayerCosts":
        return cls((forward_s,) * layers, (backward_s,) * layers, (recompute_s,) * layers,
                   first_extra_s, last_extra_s)

    @property
    def layers(self) -> int:
        return len(self.forward_s)


@dataclass(frozen=True)
class StagePlan:
    split: tuple[int, ...]  # layers per stage
    recompute: tuple[int, ...]  # recomputed layers per stage (its first ones)
    stage_s: tuple[float, ...]  # each stage's time per microbatch

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_s)

    def describe(self) -> str:
        return (f"split {','.join(map(str, self.split))} recompute "
                f"{','.join(map(str, self.recompute))}")


class _Timer:
    """Stage times from prefix sums."""

    def __init__(self, costs: LayerCosts, stages: int):
        self.costs, self.stages = costs, stages
        self.passes = [0.0, *accumulate(f + b for f, b in zip(costs.forward_s, costs.backward_s))]
        self.recomputes = [0.0, *accumulate(costs.recompute_s)]

    def __call__(self, stage: int, start: int, count: int, recomputed: int) -> float:
        c = self.costs
        extra = (c.first_extra_s if stage == 0 else 0.0) + \
            (c.last_extra_s if stage == self.stages - 1 else 0.0)
        return (self.passes[start + count] - self.passes[start] + extra
                + self.recomputes[start + recomputed] - self.recomputes[start])


def evaluate_plan(costs: LayerCosts, split, recompute) -> StagePlan:
    """The stage times of a given split and recompute plan."""
    timer, start, times = _Timer(costs, len(split)), 0, []
    for stage, (count, recomputed) in enumerate(zip(split, recompute)):
        times.append(timer(stage, start, count, recomputed))
        start += count
    return StagePlan(tuple(split), tuple(recompute), tuple(times))


def plan_stages(costs: LayerCosts, stages: int,
                fewest_recomputed: FewestRecomputed | None = None) -> StagePlan | None:
    """The split (and each stage's fewest recomputed layers) with the fastest slowest stage; None
    if no split fits. Exact for contiguous splits: stage times grow with the layers a stage
    holds, so for a time limit each stage from the last one back may take as many layers as
    stay under it, and the smallest feasible limit is one of the stage times."""
    layers = costs.layers
    if not 1 <= stages <= layers:
        raise ValueError(f"{stages} stages for {layers} layers")
    fewest = fewest_recomputed or (lambda stage, count: 0)
    timer = _Timer(costs, stages)
    recomputed: dict[tuple[int, int], int | None] = {}

    def needed(stage: int, count: int) -> int | None:
        if (stage, count) not in recomputed:
            recomputed[(stage, count)] = fewest(stage, count)
        return recomputed[(stage, count)]

    def time(stage: int, start: int, count: int) -> float:
        k = needed(stage, count)
        return float("inf") if k is None else timer(stage, start, count, k)

    def greedy(limit: float) -> tuple[int, ...] | None:
        """From the last stage back, each takes the most layers under `limit` (every count
        is tried: a pinned split leaves one count per stage that fits)."""
        end, split = layers, []
        for stage in range(stages - 1, 0, -1):
            count = max((n for n in range(1, end - stage + 1)
                         if time(stage, end - n, n) <= limit), default=0)
            if count == 0:
                return None
            split.append(count)
            end -= count
        if time(0, 0, end) > limit:
            return None
        return (end, *reversed(split))

    # every stage time that can occur, for the contiguous ranges each stage may hold
    options = sorted({time(s, a, n) for s in range(stages)
                      for a in range(s, layers - (stages - 1 - s))
                      for n in range(1, layers - (stages - 1 - s) - a + 1)} - {float("inf")})
    low, high, best = 0, len(options) - 1, None
    while low <= high:  # the smallest feasible limit
        middle = (low + high) // 2
        split = greedy(options[middle])
        if split is None:
            low = middle + 1
        else:
            best, high = split, middle - 1
    if best is None:
        return None
    return evaluate_plan(costs, best, [needed(s, n) for s, n in enumerate(best)])


def memory_bound(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                 optimizer: str, micro_batch_size: int, microbatches: int, data_parallel: int,
                 limit_bytes: float, activation_bytes_per_layer: float | None = None,
                 pinned_split: tuple[int, ...] | None = None) -> FewestRecomputed:
    """`fewest_recomputed` from the memory estimator (planner/memory.py): the fewest of a stage's
    layers that must recompute for its estimate to stay within `limit_bytes` (a pinned split
    allows only its own counts)."""
    from megatron_2bw.planner.memory import estimate_stage_memory
    layers, stages = model.num_layers, parallel.pipeline_parallel

    def total(stage: int, count: int, recomputed: int) -> float:
        split = [1] * stages  # the other stages' counts do not change this stage's memory
        split[stage] = count
        split[(stage + 1) % stages] += layers - count - (stages - 1)
        plan = [0] * stages
        plan[stage] = recomputed
        return estimate_stage_memory(
            model, dataclasses.replace(parallel, layer_split=split), precision,
            RecomputeConfig(num_layers_per_stage=plan), optimizer, micro_batch_size,
            microbatches, data_parallel, stage, activation_bytes_per_layer).total

    def fewest(stage: int, count: int) -> int | None:
        if pinned_split is not None and count != pinned_split[stage]:
            return None
        return next((k for k in range(count + 1) if total(stage, count, k) <= limit_bytes), None)
    return fewest
