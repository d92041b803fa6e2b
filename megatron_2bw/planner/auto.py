"""--auto-parallel: plan for the job's actual world at start-up and apply the plan.

Collective over all ranks: the hardware is detected together ("local") or read from a file; rank 0
profiles the model here (cached) and searches; every rank receives the same plan. Dimensions the user
typed on the command line stay pinned.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_2bw.config import Config, ConfigError
from megatron_2bw.planner.hardware import detect_hardware, load_hardware
from megatron_2bw.planner.search import (Plan, apply_plan, measured_search, pinned_search_space,
                                         rank_plans_for)


def plan_job(config: Config, world_size: int, rank: int, typed: set) -> tuple[Config, Plan]:
    par = config.parallel
    local = par.planner_hardware == "local"
    hardware = detect_hardware() if local else load_hardware(par.planner_hardware)
    chosen: list = [None]
    if rank == 0:
        profile = None
        space = pinned_search_space(config, typed)
        if local:
            profile, space = measured_search(config, world_size, hardware, space,
                                             par.planner_profile_cache)
        try:
            plans = rank_plans_for(config, world_size, hardware, profile, space, simulate_top=3)
            chosen[0] = plans[0] if plans[0].fits else min(
                plans, key=lambda plan: max(plan.memory_bytes_per_stage))
        except ValueError as error:  # no layout of this world and these pinned flags
            chosen[0] = f"--auto-parallel: {error}"
    if dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    plan = chosen[0]
    if isinstance(plan, str):  # every rank stops with rank 0's line
        raise ConfigError(plan)
    if not plan.fits:  # every rank stops with the same line
        raise ConfigError(
            f"--auto-parallel: no configuration fits in memory on {hardware.name}; the smallest "
            f"({plan.candidate.describe()}) needs {max(plan.memory_bytes_per_stage) / 2**30:.2f} "
            f"GiB per device, the limit is {plan.memory_limit_bytes / 2**30:.2f} GiB: use more "
            f"devices, a smaller model or --use-distributed-optimizer (tools/plan.py --top 20 "
            f"lists each configuration's memory)")
    return apply_plan(config, plan), plan


def describe_plan(plan: Plan) -> str:
    c = plan.candidate
    split = ",".join(map(str, c.layer_split)) if c.layer_split else "even"
    return (f"t={c.tensor_parallel} p={c.pipeline_parallel} d={c.data_parallel}, schedule "
            f"{c.schedule}, micro batch {c.micro_batch_size} (m={plan.microbatches}), recompute "
            f"{c.recompute_label}, layer split {split}: predicted "
            f"{plan.throughput_samples_per_s:.2f} samples/s ({plan.time_per_batch_s * 1000:.0f} ms "
            f"per batch), bubble {100 * plan.bubble_fraction:.0f}%, peak memory "
            f"{max(plan.memory_bytes_per_stage) / 2**20:.0f} MiB, bottleneck {plan.bottleneck}")
