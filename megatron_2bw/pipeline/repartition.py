"""Online repartitioning (vPipe): measure every layer, plan a new split and per-stage recompute plan,
and move layers between stages in the running job.

Every --pipeline-repartition-interval iterations, at a drained point (the pipeline is empty, as for
evaluation and checkpoints), the stages share their layers' measured forward and backward times
(layer_times.py), the planner's split search (planner/stage_plan.py) proposes a split and, where
the job plans recomputation per stage, a recompute plan under a memory budget; if the predicted
speed-up of the slowest stage reaches --pipeline-repartition-min-gain, the layers move:

1. each stage's state is taken as a checkpoint holds it (checkpoint/save_load.stage_state: fp32
   master weights, every live weight version, the optimizer state, the loss scaler), the
   distributed optimizer's shards gathered on the stage's data-parallel rank 0;
2. those ranks send the state of each moving layer to the rank of its new stage (same tensor
   rank), in one global order of point-to-point transfers (no deadlock);
3. each stage's data-parallel rank 0 broadcasts its new stage's state to its replicas, every rank
   rebuilds its stage for the new split (training.build_stage) and loads it, each keeping its
   shard under the distributed optimizer; the RNG states stay as they were.

A migration changes where a layer runs, not what it computes: the run continues exactly as one
started with the new split (see docs/repartition.md for the conditions). Nothing is written to
disk: a failure half-way ends the job naming the rank, and the last checkpoint stays as it was.
"""
from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_2bw.checkpoint.reshard import _merge_optimizer_groups
from megatron_2bw.checkpoint.save_load import optimizer_state_by_index, stage_state
from megatron_2bw.config import Config
from megatron_2bw.distributed.p2p import recv_object, send_object
from megatron_2bw.pipeline.layer_times import LayerTimes, StageTimes
from megatron_2bw.pipeline.partition import layer_ranges
from megatron_2bw.planner.stage_plan import LayerCosts, StagePlan, evaluate_plan, plan_stages
from megatron_2bw.tensor_parallel.random import load_rng_state_dict, rng_state_dict

LAYER_PREFIX = "transformer.layers."


class RepartitionError(RuntimeError):
    """A migration that could not complete; the message names the rank."""


def layer_of(name: str) -> int | None:
    """The global layer index of a parameter name, None for the embedding and the heads."""
    if not name.startswith(LAYER_PREFIX):
        return None
    return int(name[len(LAYER_PREFIX):].split(".", 1)[0])


def stage_split(config: Config) -> list[int]:
    par = config.parallel
    return [len(r) for r in layer_ranges(config.model.num_layers, par.pipeline_parallel,
                                         par.layer_split)]


def stage_recompute_plan(config: Config) -> list[int]:
    """Each stage's recomputed layers under a per-stage plan, zeros without one."""
    return list(config.recompute.num_layers_per_stage or [0] * config.parallel.pipeline_parallel)


def with_plan(config: Config, split, recompute) -> Config:
    """A copy of `config` running `split` (and `recompute`, where the job plans per stage)."""
    result = copy.deepcopy(config)
    result.parallel.layer_split = list(split)
    if result.recompute.num_layers_per_stage is not None or any(recompute):
        result.recompute.num_layers_per_stage = list(recompute)
    return result


# -- measuring and planning ----------------------------------------------------------------------

def measured_costs(config: Config, measurements: list[StageTimes]) -> LayerCosts:
    """Per-microbatch layer costs from every rank's StageTimes (the slowest rank holding a layer
    counts); a recomputed layer's measured backward holds its recomputation, which is taken out
    (its cost is then its forward again). Each stage's embedding and head: its forward beyond
    the layers', and twice that backward."""
    split, plan = stage_split(config), stage_recompute_plan(config)
    ranges = layer_ranges(config.model.num_layers, len(split), split)
    layers = config.model.num_layers
    forward, backward = [0.0] * layers, [0.0] * layers
    extra = [0.0] * len(split)
    for times in measurements:
        for layer, seconds in times.layer_forward_s.items():
            forward[layer] = max(forward[layer], seconds)
        for layer, seconds in times.layer_backward_s.items():
            backward[layer] = max(backward[layer], seconds)
        if times.layer_forward_s:
            stage = next(s for s, r in enumerate(ranges) if min(times.layer_forward_s) in r)
            beyond = times.stage_forward_s - sum(times.layer_forward_s.values())
            extra[stage] = max(extra[stage], 3 * max(beyond, 0.0))
    for stage, r in enumerate(ranges):
        for layer in list(r)[:plan[stage]]:
            backward[layer] = max(backward[layer] - forward[layer], 0.0)
    return LayerCosts(tuple(forward), tuple(backward), tuple(forward), extra[0], extra[-1])


def memory_budget(config: Config, device: torch.device, microbatches: int, data: int):
    """fewest_recomputed for the search: each stage's estimate (planner/memory.py) within the
    device's memory (GPUs) or the node's memory shared by its local ranks (CPUs)."""
    from megatron_2bw.distributed.launch import local_world_size
    from megatron_2bw.planner.memory import ALLOCATOR_EFFICIENCY
    from megatron_2bw.planner.stage_plan import memory_bound
    c = config
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local_world_size()
    return memory_bound(c.model, c.parallel, c.precision, c.optimizer.optimizer,
                        c.training.micro_batch_size, microbatches, data,
                        total * ALLOCATOR_EFFICIENCY)


@dataclass(frozen=True)
class Decision:
    iteration: int
    current: StagePlan
    proposed: StagePlan

    @property
    def gain(self) -> float:
        return self.current.bottleneck_s / self.proposed.bottleneck_s - 1

    def changes(self) -> bool:
        return (self.current.split, self.current.recompute) != \
            (self.proposed.split, self.proposed.recompute)


def decide(config: Config, costs: LayerCosts, iteration: int, fewest=None) -> Decision:
    """The current plan's and the best plan's stage times under `costs`. Recompute plans are
    searched only where the job plans recomputation per stage (or none): a job-wide setting
    stays as it is."""
    current = evaluate_plan(costs, stage_split(config), stage_recompute_plan(config))
    recompute = config.recompute
    per_stage = recompute.num_layers_per_stage is not None or recompute.granularity is None
    proposed = plan_stages(costs, config.parallel.pipeline_parallel,
                           fewest if per_stage else None) or current
    if proposed.bottleneck_s >= current.bottleneck_s:
        proposed = current
    return Decision(iteration, current, proposed)


# -- moving state ----------------------------------------------------------------------------

def _select(state: dict, names) -> dict:
    """The part of a stage_state dict that concerns `names`."""
    names = set(names)
    return {"model": {n: t for n, t in state["model"].items() if n in names},
            "versions": {v: {n: t for n, t in tensors.items() if n in names}
                         for v, tensors in state["versions"].items()},
            "optimizer": {"groups": [{**g, "params": [n for n in g["params"] if n in names]}
                                     for g in state["optimizer"]["groups"]],
                          "state": {n: s for n, s in state["optimizer"]["state"].items()
                                    if n in names}},
            "specs": {n: s for n, s in state["specs"].items() if n in names}}


def _merge(into: dict, part: dict) -> None:
    into["model"].update(part["model"])
    for version, tensors in part["versions"].items():
        into["versions"].setdefault(version, {}).update(tensors)
    into["optimizer"]["state"].update(part["optimizer"]["state"])
    _merge_optimizer_groups(into["optimizer"]["groups"], part["optimizer"]["groups"])
    into["specs"].update(part["specs"])


def _transfer(obj, source: int, destination: int, rank: int, what: str, device):
    """Blocking object transfer source -> destination; a failure names the other rank."""
    peer = destination if rank == source else source
    try:
        if rank == source:
            send_object(obj, destination, device)
            return None
        return recv_object(source, device)
    except Exception as error:  # noqa: BLE001 - the peer's failure, named
        raise RepartitionError(f"{what}: the transfer with rank {peer} failed ({error}); "
                               f"rank {peer} stopped during the migration (nothing was written: the "
                               f"last checkpoint stays as it was)") from error


def migrate(stage, split, recompute, build):
    """Move layers so that stage.config runs `split` and `recompute`; collective over all ranks at
    a drained point. `build(config)` builds this rank's stage for a config. Returns the new stage."""
    layout, config, iteration = stage.layout, stage.config, stage.iteration
    new_config = with_plan(config, split, recompute)
    old = layer_ranges(config.model.num_layers, layout.pipeline, stage_split(config))
    new = layer_ranges(config.model.num_layers, layout.pipeline, list(split))
    c = layout.coords
    what = f"repartition at iteration {iteration}"
    device = stage.device if stage.device.type == "cuda" else None
    writer = layout.rank_of(c.tp, 0, c.pp)
    master = stage.versions.full_master(dst=writer)  # the distributed optimizer's: gathered
    if hasattr(stage.optimizer, "consolidate_state_dict"):
        stage.optimizer.consolidate_state_dict(to=writer)
    state = stage_state(stage, master) if c.dp == 0 else None
    rng = rng_state_dict()
    moves = sorted({(a, b) for a in range(layout.pipeline) for b in range(layout.pipeline)
                    if a != b and set(old[a]) & set(new[b])})
    kept = None
    if state is not None:
        kept = _select(state, [n for n in state["model"]
                               if layer_of(n) is None or layer_of(n) in new[c.pp]])
        kept.update({k: v for k, v in state.items() if k not in kept})
        for a, b in moves:  # the same order on every rank
            if c.pp not in (a, b):
                continue
            source, destination = layout.rank_of(c.tp, 0, a), layout.rank_of(c.tp, 0, b)
            part = None
            if c.pp == a:
                part = _select(state, [n for n in state["model"] if layer_of(n) in new[b]])
            part = _transfer(part, source, destination, layout.rank, what, device)
            if part is not None:
                _merge(kept, part)
    del state, master
    if layout.data > 1:  # the replicas take the new stage's state from data-parallel rank 0
        shared = [kept]
        try:
            dist.broadcast_object_list(shared, src=writer, group=layout.group("data"),
                                       device=device)
        except Exception as error:  # noqa: BLE001
            raise RepartitionError(f"{what}: the broadcast from rank {writer} to its data-parallel "
                                   f"replicas failed ({error})") from error
        kept = shared[0]
    stage.executor = stage.model = stage.versions = stage.optimizer = None  # free the old stage
    fresh = build(new_config)
    load_stage(fresh, kept, iteration)
    fresh.consumed_samples = stage.consumed_samples
    fresh.consumed_valid_samples = stage.consumed_valid_samples
    fresh.step_results = stage.step_results
    load_rng_state_dict(rng)
    return fresh


@torch.no_grad()
def load_stage(stage, state: dict, iteration: int) -> None:
    """Fill a freshly built stage from a stage_state dict of its parameters (every live version,
    the optimizer state, the loss scaler), as a checkpoint load does."""
    v = stage.versions
    missing = [n for n in v.names if n not in state["model"]]
    if missing:
        raise RepartitionError(f"repartition at iteration {iteration}: stage {stage.layout.stage} "
                               f"received no state for {missing[:3]}")
    v.load_full_master([state["model"][n] for n in v.names])
    saved = {int(version): tensors for version, tensors in state["versions"].items()}
    # every version from the one the next batch reads on this stage to the newest
    live = set(saved) | set(range(v.version_for_batch(iteration), iteration + 1))
    v.reset(iteration, {version: [saved.get(version, state["model"])[n] for n in v.names]
                        for version in sorted(live)})
    names_of = {id(m): name for name, m in zip(v.names, v.master)}
    stage.optimizer.load_state_dict(optimizer_state_by_index(stage.optimizer, state["optimizer"],
                                                             names_of))
    if state.get("loss_scaler"):
        stage.scaler.load_state_dict(state["loss_scaler"])
    stage.iteration = iteration


# -- the training loop's side ----------------------------------------------------------------

class Repartitioner:
    """--pipeline-repartition-interval: measure, decide at each interval's drained point, move."""

    def __init__(self, config: Config, log):
        par = config.parallel
        self.interval, self.min_gain = par.repartition_interval, par.repartition_min_gain
        self.log = log  # a callable printing one line on the writing rank
        self.times: LayerTimes | None = None
        self.decisions: list[tuple[Decision, float | None]] = []

    def attach(self, stage) -> None:
        if self.times is not None:
            self.times.remove()
        self.times = LayerTimes(stage.model, stage.device)

    def due(self, iteration: int) -> bool:
        return iteration % self.interval == 0

    def gather(self, stage) -> list[StageTimes]:
        mine = self.times.collect()
        self.times.reset()
        if stage.layout.world_size == 1:
            return [mine]
        everyone = [None] * stage.layout.world_size
        dist.all_gather_object(everyone, mine)
        return everyone

    def __call__(self, stage, build):
        """At a drained point on every rank: the stage to go on with (a new one if layers
        moved)."""
        costs = measured_costs(stage.config, self.gather(stage))
        fewest = memory_budget(stage.config, stage.device, stage.microbatches, stage.layout.data)
        decision = decide(stage.config, costs, stage.iteration, fewest)
        moving = decision.changes() and decision.gain >= self.min_gain
        seconds = None
        if moving:
            start = time.perf_counter()
            stage = migrate(stage, decision.proposed.split, decision.proposed.recompute, build)
            if dist.is_initialized() and stage.layout.world_size > 1:
                dist.barrier()
            seconds = time.perf_counter() - start
            self.attach(stage)
        self.decisions.append((decision, seconds))
        self.log(describe(decision, seconds, self.min_gain))
        return stage


def describe(decision: Decision, seconds: float | None, min_gain: float) -> str:
    old, new = decision.current, decision.proposed
    head = (f" repartition at iteration {decision.iteration}: {old.describe()} -> "
            f"{new.describe()}, predicted gain {100 * decision.gain:.1f}%")
    if seconds is not None:
        return f"{head}, moved in {seconds:.3f} s"
    reason = "no better plan" if not decision.changes() else \
        f"below --pipeline-repartition-min-gain {100 * min_gain:.1f}%"
    return f"{head}, kept ({reason})"
