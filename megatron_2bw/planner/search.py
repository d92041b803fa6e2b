"""Rank every (t, p, d, micro batch, recomputation, schedule) for a model on a cluster.

For each candidate: a layer split balancing the stages' compute (the first stage also embeds, the
last also runs the head), per-stage memory (memory.py) against the device's usable memory, and
per-stage durations (cost.py). Throughput comes from replaying the schedule (simulator.py, 3
batches) for the contenders: per schedule, candidates are replayed best lower bound first until the
`simulate_top` best replayed ones beat every remaining candidate's lower bound. The rest keep the
paper's closed-form estimate (`simulated` is False): they cannot enter that top. Configurations that
do not fit are not replayed and rank after every one that does. --sequence-parallel is not a
dimension of the search: every candidate is planned with the model's setting as given (with it, t
must also divide the sequence).

`best_plan(config, world, hardware)` is what a caller (tools/plan.py, the runtime's
--auto-parallel) needs; `apply_plan` turns it into a Config.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from tqdm import tqdm

from megatron_2bw.config import Config, ModelConfig, ParallelConfig, PrecisionConfig, RecomputeConfig
from megatron_2bw.pipeline.schedules import SCHEDULES, VersionRule

# what --pipeline-schedule offers (PipeDream's vertical sync is a flag of its own, not planned)
# PipeMare's update rule differs from the others' (and its time is 2BW's): planned only where
# --pipeline-schedule pipemare pins it, never chosen in place of another schedule
# the V schedules are not planned: the runtime does not run them yet
PLANNED_SCHEDULES = tuple(s for s in SCHEDULES if s not in ("pipedream-vs", "pipemare", "zb-v",
                                                            "dualpipev"))
from megatron_2bw.planner.cost import (RECOMPUTE_OPTIONS, Candidate, CoreSharing, StageCost,
                                       balanced_split, bottleneck_label, busiest_stage,
                                       core_sharing, layer_costs, paper_breakdown, stage_costs,
                                       time_per_batch_lower_bound)
from megatron_2bw.planner.hardware import HardwareSpec
from megatron_2bw.planner.memory import StageMemory, estimate_stage_memory, memory_limit_bytes
from megatron_2bw.planner.analytic_profile import AnalyticProfile
from megatron_2bw.planner.measured_profile import (MeasuredProfile, measured_profile,
                                                   profiling_processes, turn_taking_processors)
from megatron_2bw.planner.profile import ComputeCosts, Profile
from megatron_2bw.planner.simulator import Compiled, compiled_schedule, simulate
from megatron_2bw.planner.stage_plan import memory_bound, plan_stages

SIMULATED_BATCHES = 3


@dataclass(frozen=True)
class SearchSpace:
    """Restrictions of the search; None means every valid value."""
    tensor_parallel: tuple[int, ...] | None = None
    pipeline_parallel: tuple[int, ...] | None = None
    micro_batch_sizes: tuple[int, ...] | None = None
    recompute: tuple[str | None, ...] = RECOMPUTE_OPTIONS
    schedules: tuple[str, ...] = PLANNED_SCHEDULES
    layer_split: tuple[int, ...] | None = None  # pinned layers per stage (pins p too)
    chunks: int = 2  # interleaved: model chunks per rank
    balance_layers: bool = True  # otherwise the runtime's even split (when no split is pinned)
    # where a configuration without recomputation does not fit: the split and per-stage
    # recompute plan chosen together (stage_plan.py), as another candidate
    per_stage_recompute: bool = True


@dataclass(frozen=True)
class Plan:
    candidate: Candidate
    microbatches: int
    time_per_batch_s: float
    throughput_samples_per_s: float
    stage_memory: tuple[StageMemory, ...]
    memory_limit_bytes: float
    fits: bool
    bottleneck: str
    bubble_fraction: float
    simulated: bool  # False: the closed-form estimate (not a contender, or does not fit)
    breakdown: dict = field(default_factory=dict)  # busiest stage's time per batch by cause

    @property
    def memory_bytes_per_stage(self) -> list[float]:
        return [m.total for m in self.stage_memory]

    def to_json(self) -> dict:
        c = self.candidate
        return {"tensor_parallel": c.tensor_parallel, "pipeline_parallel": c.pipeline_parallel,
                "data_parallel": c.data_parallel, "micro_batch_size": c.micro_batch_size,
                "microbatches": self.microbatches,
                "recompute": "per-stage" if c.recompute_layers else c.recompute or "none",
                "recompute_layers": list(c.recompute_layers or ()),
                "schedule": c.schedule, "layer_split": list(c.layer_split or ()),
                "throughput_samples_per_s": self.throughput_samples_per_s,
                "time_per_batch_s": self.time_per_batch_s,
                "memory_bytes_per_stage": [int(x) for x in self.memory_bytes_per_stage],
                "memory_limit_bytes": int(self.memory_limit_bytes), "fits": self.fits,
                "bottleneck": self.bottleneck, "bubble_fraction": self.bubble_fraction,
                "simulated": self.simulated}


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


def schedules_for(pipeline_parallel: int, schedules: tuple[str, ...]) -> tuple[str, ...]:
    """With one stage there is no pipeline: GPipe and 2BW do Flush's work in Flush's time, GPipe
    holding all m microbatches' activations and 2BW a second weight version and a 1-stale gradient.
    So p = 1 is planned with Flush alone (the runtime's default there) unless the search was pinned
    to other schedules."""
    if pipeline_parallel == 1 and "flush" in schedules:
        return ("flush",)
    return schedules


def splits_model(model: ModelConfig, tensor_parallel: int) -> bool:
    """Whether t divides what tensor parallelism splits: the heads, the query groups (each rank
    holds whole groups), the hidden and the ffn sizes, and under --sequence-parallel the sequence
    (planned as the user set it: sequence parallelism is not searched)."""
    sequence = (model.seq_length,) if model.sequence_parallel else ()
    return not any(size % tensor_parallel for size in (
        model.num_attention_heads, model.query_groups, model.hidden_size, model.ffn_hidden_size,
        *sequence))


def candidates(model: ModelConfig, world_size: int, hardware: HardwareSpec, global_batch_size: int,
               space: SearchSpace | None = None) -> list[Candidate]:
    """Every valid configuration: t inside a node and splitting the model (`splits_model`); p at
    most the layers; d = world / (t p) dividing the global batch; micro batch sizes dividing the
    per-replica batch; 2BW, Flush and ZB-H1 need at least p microbatches per batch, interleaved
    (planned with v = 2) a multiple of p and 2p dividing the layers; PipeDream and PipeMare need
    untied embeddings, PipeMare no full recomputation; one schedule at p = 1 (`schedules_for`)."""
    space = space or SearchSpace()
    per_node = hardware.devices_per_node
    result = []
    for t in _divisors(world_size):
        if (t > per_node or per_node % t or not splits_model(model, t)
                or (space.tensor_parallel is not None and t not in space.tensor_parallel)):
            continue
        for p in _divisors(world_size // t):
            if p > model.num_layers or (space.pipeline_parallel is not None
                                        and p not in space.pipeline_parallel) \
                    or (space.layer_split is not None and p != len(space.layer_split)):
                continue
            d = world_size // (t * p)
            if global_batch_size % d:
                continue
            for b in _divisors(global_batch_size // d):
                if space.micro_batch_sizes is not None and b not in space.micro_batch_sizes:
                    continue
                m = global_batch_size // (b * d)
                for schedule in schedules_for(p, space.schedules):
                    if schedule in ("2bw", "flush", "zb-h1") and m < p:
                        continue
                    if schedule in ("pipedream", "pipemare") and not (
                            model.untie_embeddings_and_output_weights and model.model_type == "gpt"):
                        continue  # the first and last stage would read two versions of one matrix
                    chunks = 1
                    if schedule == "interleaved":  # two chunks per rank unless pinned
                        chunks = space.chunks
                        if p == 1 or m % p or space.layer_split or \
                                model.num_layers % (chunks * p):
                            continue
                    for recompute in space.recompute:
                        if schedule == "pipemare" and recompute == "full":
                            continue  # no forward-time weights to recompute with
                        result.append(Candidate(t, p, d, b, recompute, schedule,
                                                space.layer_split, chunks))
    return result


def pinned_conflicts(model: ModelConfig, world_size: int, devices_per_node: int,
                     global_batch_size: int, space: SearchSpace) -> list[str]:
    """Why pinned sizes leave no configuration, naming their flags (empty if none is to blame)."""
    reasons = []
    for t in space.tensor_parallel or ():
        if world_size % t or devices_per_node % t or not splits_model(model, t):
            sequence = f", --seq-length {model.seq_length} (--sequence-parallel)" \
                if model.sequence_parallel else ""
            reasons.append(f"--tensor-model-parallel-size {t} must divide the world size "
                           f"{world_size}, the {devices_per_node} devices of a node, the "
                           f"{model.num_attention_heads} heads, the {model.query_groups} query "
                           f"groups and the hidden and ffn sizes{sequence}")
    for p in space.pipeline_parallel or ():
        if world_size % p or p > model.num_layers:
            reasons.append(f"--pipeline-model-parallel-size {p} must divide the world size "
                           f"{world_size} and be at most --num-layers {model.num_layers}")
    split = space.layer_split
    if split is not None and world_size % len(split):
        reasons.append(f"--pipeline-layer-split {','.join(map(str, split))} gives "
                       f"{len(split)} stages, which must divide the world size {world_size}")
    for b in space.micro_batch_sizes or ():
        if not any(global_batch_size % d == 0 and (global_batch_size // d) % b == 0
                   for d in _divisors(world_size)):
            reasons.append(f"--micro-batch-size {b} must divide a replica's batch "
                           f"(--global-batch-size {global_batch_size} / d)")
    return reasons


# micro batch sizes measured for a search on the machine at hand when none is pinned
PROFILED_MICRO_BATCH_SIZES = (1, 2, 4, 8)


def measured_profile_for(config: Config, world_size: int, hardware: HardwareSpec,
                         space: SearchSpace | None, micro_batch_sizes: list[int],
                         cache_dir=None, progress: bool = False) -> MeasuredProfile:
    """The profile measured here for a search: every tensor-parallel size it will consider (each
    timed on one rank's shard) at `micro_batch_sizes`."""
    tensor_sizes = sorted({c.tensor_parallel for c in candidates(
        config.model, world_size, hardware.for_world(world_size),
        config.training.global_batch_size, space)})
    return measured_profile(config.model, config.precision, hardware, micro_batch_sizes, cache_dir,
                            progress=progress, tensor_parallel_sizes=tensor_sizes,
                            processes=profiling_processes(hardware, world_size),
                            turn_taking_processors=turn_taking_processors(hardware, world_size))


def measured_search(config: Config, world_size: int, hardware: HardwareSpec, space: SearchSpace,
                    cache_dir=None, progress: bool = False) -> tuple[MeasuredProfile, SearchSpace]:
    """Profile here the micro batch sizes a search may choose (a pinned one, else
    PROFILED_MICRO_BATCH_SIZES up to the global batch) and keep the search to them: a plan never
    rests on a size extrapolated from smaller ones. (The quickstart once chose micro batch 16
    extrapolated from 1-8: predicted 114 samples/s, measured 79.)"""
    if config.training.global_batch_size is None:
        raise ValueError("planning needs --global-batch-size")
    sizes = list(space.micro_batch_sizes) if space.micro_batch_sizes else \
        [b for b in PROFILED_MICRO_BATCH_SIZES if b <= config.training.global_batch_size]
    profile = measured_profile_for(config, world_size, hardware, space, sizes, cache_dir,
                                   progress=progress)
    return profile, dataclasses.replace(space, micro_batch_sizes=tuple(sizes))


def recompute_config(granularity: str | None,
                     per_stage: tuple[int, ...] | None = None) -> RecomputeConfig:
    """The runtime's recomputation settings for a planner choice (full: every layer, one by one;
    a per-stage plan: each stage's first layers)."""
    if per_stage is not None:
        return RecomputeConfig(num_layers_per_stage=list(per_stage))
    if granularity == "full":
        return RecomputeConfig(granularity="full", method="uniform", num_layers=1)
    return RecomputeConfig(granularity=granularity)


@dataclass
class _Assessed:
    """A candidate before (or without) the replay."""
    candidate: Candidate
    microbatches: int
    memory: tuple[StageMemory, ...]
    fits: bool
    durations: list[StageCost]
    sharing: CoreSharing | None
    lower_bound_s: float


class _Planner:
    def __init__(self, model: ModelConfig, hardware: HardwareSpec, global_batch_size: int,
                 precision: PrecisionConfig, optimizer: str, parallel: ParallelConfig | None,
                 profile: Profile, balance_layers: bool):
        self.model, self.hardware, self.global_batch_size = model, hardware, global_batch_size
        self.precision, self.optimizer, self.parallel = precision, optimizer, parallel
        self.profile, self.balance_layers = profile, balance_layers
        self.memory_limit = memory_limit_bytes(hardware)
        self._costs: dict[tuple[int, int], ComputeCosts] = {}
        self._schedules: dict[tuple, Compiled] = {}  # shared by candidates

    def costs(self, t: int, b: int) -> ComputeCosts:
        if (t, b) not in self._costs:
            self._costs[(t, b)] = self.profile.costs(t, b)
        return self._costs[(t, b)]

    def assess(self, candidate: Candidate) -> _Assessed:
        costs = self.costs(candidate.tensor_parallel, candidate.micro_batch_size)
        if self.balance_layers and candidate.layer_split is None:
            candidate = dataclasses.replace(candidate, layer_split=balanced_split(
                self.model, self.hardware, costs, candidate, self.precision))
        m = candidate.microbatches(self.global_batch_size)
        per_layer = costs.activation_bytes_per_layer(candidate.recompute)
        parallel_config = candidate.parallel_config(self.parallel)
        memory = tuple(estimate_stage_memory(
            self.model, parallel_config, self.precision,
            recompute_config(candidate.recompute, candidate.recompute_layers), self.optimizer, candidate.micro_batch_size, m, candidate.data_parallel, s, per_layer)
            for s in range(candidate.pipeline_parallel))
        durations = stage_costs(self.model, self.hardware, costs, candidate, self.precision,
                                self.optimizer, self.parallel)
        sharing = core_sharing(self.hardware, candidate)
        bound = time_per_batch_lower_bound(durations, candidate.schedule, m, candidate.chunks)
        return _Assessed(candidate, m, memory,
                         max(x.total for x in memory) <= self.memory_limit, durations, sharing,
                         max(bound, sharing.bound(durations, m)) if sharing else bound)

    def stage_plan(self, candidate: Candidate) -> Candidate | None:
        """`candidate` (no recomputation) with the split and per-stage recompute plan chosen
        together under the memory limit (a pinned split stays); None if nothing fits."""
        c = candidate
        costs = self.costs(c.tensor_parallel, c.micro_batch_size)
        fewest = memory_bound(self.model, c.parallel_config(self.parallel), self.precision,
                              self.optimizer, c.micro_batch_size,
                              c.microbatches(self.global_batch_size), c.data_parallel,
                              self.memory_limit, costs.activation_bytes_per_layer(None),
                              c.layer_split)
        found = plan_stages(layer_costs(self.model, self.hardware, costs, c, self.precision),
                            c.pipeline_parallel, fewest)
        if found is None:
            return None
        return dataclasses.replace(c, layer_split=found.split, recompute_layers=found.recompute)

    def plan(self, item: _Assessed, replay: bool) -> Plan:
        c, m = item.candidate, item.microbatches
        if replay:
            shape = (c.schedule, c.pipeline_parallel, m, c.chunks)
            if shape not in self._schedules:
                self._schedules[shape] = compiled_schedule(*shape[:3], SIMULATED_BATCHES,
                                                           c.chunks)
            result = simulate(self._schedules[shape], item.durations, sharing=item.sharing,
                              stage_local_steps=not VersionRule(*shape[:2]).global_step_decisions)
            seconds, bubble = result.time_per_batch, result.bubble_fraction
            breakdown, bottleneck = result.breakdown, result.bottleneck
        else:
            breakdown = paper_breakdown(item.durations, c.schedule, m, c.chunks)
            seconds = sum(breakdown.values())
            shared = item.sharing.bound(item.durations, m) if item.sharing else 0.0
            if shared > seconds:  # the node's processors, not the schedule, set the pace
                breakdown["shared_cores"] = shared - seconds
                seconds = shared
            bubble = breakdown["bubble"] / seconds
            bottleneck = bottleneck_label(breakdown, busiest_stage(item.durations, m))
        return Plan(candidate=c, microbatches=m, time_per_batch_s=seconds,
                    throughput_samples_per_s=self.global_batch_size / seconds,
                    stage_memory=item.memory, memory_limit_bytes=self.memory_limit,
                    fits=item.fits, bottleneck=bottleneck, bubble_fraction=bubble,
                    simulated=replay, breakdown=breakdown)


def _rank_key(plan: Plan):
    return (not plan.fits, not plan.simulated, -plan.throughput_samples_per_s,
            max(plan.memory_bytes_per_stage))


def rank_plans(model: ModelConfig, world_size: int, hardware: HardwareSpec, global_batch_size: int,
               precision: PrecisionConfig, optimizer: str = "adam",
               parallel: ParallelConfig | None = None, profile: Profile | None = None,
               space: SearchSpace | None = None, simulate_top: int = 8,
               progress: bool = False) -> list[Plan]:
    """Every candidate, ranked: replayed fitting ones by throughput, then fitting ones that cannot
    reach the top `simulate_top` of their schedule (closed form), then those that do not fit."""
    space = space or SearchSpace()
    hardware = hardware.for_world(world_size)
    profile = profile or AnalyticProfile(model, precision, hardware)
    pool = candidates(model, world_size, hardware, global_batch_size, space)
    if not pool:
        reasons = pinned_conflicts(model, world_size, hardware.devices_per_node,
                                   global_batch_size, space)
        raise ValueError(f"no valid parallel configuration for world size {world_size}, global "
                         f"batch {global_batch_size} and this model: " + ("; ".join(reasons) or
                         f"t must divide the heads, the query groups and the "
                         f"{hardware.devices_per_node} devices of a node, p <= layers, and 2BW and Flush need at least p microbatches "
                         f"per batch"))
    planner = _Planner(model, hardware, global_batch_size, precision, optimizer, parallel, profile,
                       space.balance_layers)
    assessed = [planner.assess(c) for c in tqdm(pool, desc="costing", unit="config",
                                                disable=not progress)]
    if space.per_stage_recompute:
        planned = (planner.stage_plan(dataclasses.replace(a.candidate,
                                                          layer_split=space.layer_split))
                   for a in assessed
                   if a.candidate.recompute is None and not a.fits)
        assessed += [planner.assess(c) for c in planned if c is not None]
    plans = []
    for schedule in space.schedules:
        fitting = sorted((a for a in assessed if a.fits and a.candidate.schedule == schedule),
                         key=lambda a: a.lower_bound_s)
        best: list[float] = []  # replayed times, ascending
        for item in tqdm(fitting, desc=f"replaying {schedule}", unit="config",
                         disable=not progress):
            replay = len(best) < simulate_top or item.lower_bound_s < best[-1]
            plan = planner.plan(item, replay)
            plans.append(plan)
            if replay:
                best = sorted(best + [plan.time_per_batch_s])[:simulate_top]
    plans += [planner.plan(a, replay=False) for a in assessed if not a.fits]
    return sorted(plans, key=_rank_key)


def rank_plans_for(config: Config, world_size: int, hardware: HardwareSpec,
                   profile: Profile | None = None, space: SearchSpace | None = None,
                   simulate_top: int = 8, progress: bool = False) -> list[Plan]:
    """`rank_plans` with the model, batch, precision and optimizer of a training Config."""
    if config.training.global_batch_size is None:
        raise ValueError("planning needs --global-batch-size")
    return rank_plans(config.model, world_size, hardware, config.training.global_batch_size,
                      config.precision, config.optimizer.optimizer, config.parallel, profile,
                      space, simulate_top, progress)


def best_plan(config: Config, world_size: int, hardware: HardwareSpec,
              profile: Profile | None = None, space: SearchSpace | None = None) -> Plan:
    """The fastest configuration that fits; ValueError naming the smallest need if none does."""
    plans = rank_plans_for(config, world_size, hardware, profile, space, simulate_top=1)
    if not plans[0].fits:
        least = min(plans, key=lambda plan: max(plan.memory_bytes_per_stage))
        raise ValueError(f"no configuration fits in {least.memory_limit_bytes / 2**30:.1f} GiB "
                         f"per device; the smallest ({least.candidate.describe()}) needs "
                         f"{max(least.memory_bytes_per_stage) / 2**30:.1f} GiB")
    return plans[0]


def pinned_search_space(config: Config, typed: set[tuple[str, str]]) -> SearchSpace:
    """The search with every dimension the user typed on the command line pinned to its value;
    `typed` holds (section, field) pairs (megatron_2bw.arguments.explicit_fields)."""
    par = config.parallel

    def pinned(section: str, name: str, value):
        return (value,) if (section, name) in typed else None

    space = SearchSpace(
        tensor_parallel=pinned("parallel", "tensor_parallel", par.tensor_parallel),
        pipeline_parallel=pinned("parallel", "pipeline_parallel", par.pipeline_parallel),
        micro_batch_sizes=pinned("training", "micro_batch_size", config.training.micro_batch_size),
        layer_split=tuple(par.layer_split) if par.layer_split else None)  # pins p as well
    if ("recompute", "granularity") in typed or config.recompute.granularity is not None:
        space = dataclasses.replace(space, recompute=(config.recompute.granularity,))
    virtual = {("parallel", "virtual_pipeline_parallel"),
               ("parallel", "num_layers_per_virtual_pipeline_stage")}
    if virtual & typed:  # Megatron-LM's virtual-stage flags select interleaved, with their v
        space = dataclasses.replace(space, schedules=("interleaved",),
                                    chunks=par.virtual_pipeline_parallel or 2)
    if ("parallel", "schedule") in typed:
        space = dataclasses.replace(space, schedules=(par.schedule,))
    return space


def apply_plan(config: Config, plan: Plan) -> Config:
    """A copy of `config` set up to run `plan` (parallel sizes, layer split, schedule, micro batch
    size, recomputation)."""
    result = copy.deepcopy(config)
    result.parallel = plan.candidate.parallel_config(config.parallel)
    result.training.micro_batch_size = plan.candidate.micro_batch_size
    result.recompute = recompute_config(plan.candidate.recompute, plan.candidate.recompute_layers)
    return result
