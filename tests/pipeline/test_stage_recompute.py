"""Per-stage recomputation (--recompute-num-layers-per-stage): each stage recomputes its own number
of layers under every schedule. Recomputation changes memory, never the arithmetic: the weights
equal a run without it bit for bit, while the stage that recomputes stashes less (measured) and
the estimator counts each stage's own plan."""
import dataclasses

import pytest
import torch

from megatron_2bw.config import PrecisionConfig, RecomputeConfig
from megatron_2bw.pipeline.partition import chunk_recompute, stage_recompute
from megatron_2bw.planner.memory import estimate_stage_memory
from megatron_2bw.training.segments import run_segment
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, gpt_feed, rank_weights, stage_on_rank, tiny_config


def test_each_stage_gets_its_own_block_recomputation():
    plan = RecomputeConfig(num_layers_per_stage=[3, 0, 1])
    assert stage_recompute(plan, 0) == RecomputeConfig("full", "block", 3)
    assert stage_recompute(plan, 1).granularity is None
    assert stage_recompute(plan, 2) == RecomputeConfig("full", "block", 1)
    uniform = RecomputeConfig("full", "uniform", 1)
    assert stage_recompute(uniform, 1) is uniform


def _train(rank, world, config, batches):
    layout, stage = stage_on_rank(rank, world, config)
    run_segment(stage, 0, batches, gpt_feed(config, layout))
    return {**rank_weights(layout, stage), "peak_activations": stage.memory.peak_activation_bytes}


@pytest.mark.parametrize("schedule", ["flush", "gpipe", "2bw"])
def test_every_schedule_recomputes_per_stage_without_changing_the_weights(schedule):
    base = tiny_config(p=2, schedule=schedule, optimizer="adam", lr=0.01)
    planned = tiny_config(p=2, schedule=schedule, optimizer="adam", lr=0.01)
    planned.parallel.layer_split = [3, 1]
    base.parallel.layer_split = [3, 1]
    planned.recompute = RecomputeConfig(num_layers_per_stage=[2, 0])
    plain = sorted(run_ranks(2, _train, base, 3), key=lambda r: r["coords"][2])
    recomputed = sorted(run_ranks(2, _train, planned, 3), key=lambda r: r["coords"][2])
    a, b = full_weights(plain), full_weights(recomputed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # stage 0 stashes 2 of its 3 layers' activations less; stage 1, without a plan, the same
    assert recomputed[0]["peak_activations"] < 0.85 * plain[0]["peak_activations"]
    assert recomputed[1]["peak_activations"] == plain[1]["peak_activations"]


def test_the_estimate_counts_each_stage_plan():
    config = tiny_config(p=2, schedule="flush", layers=6)
    parallel = dataclasses.replace(config.parallel, layer_split=[3, 3])

    def activations(plan, stage):
        return estimate_stage_memory(config.model, parallel, PrecisionConfig(),
                                     RecomputeConfig(num_layers_per_stage=plan), "adam", 2, 4, 1,
                                     stage).activations
    assert activations([3, 0], 0) < activations([1, 0], 0) < activations([0, 0], 0)
    assert activations([3, 0], 1) == activations([0, 0], 1)
    block = estimate_stage_memory(config.model, parallel, PrecisionConfig(),
                                  RecomputeConfig("full", "block", 2), "adam", 2, 4, 1, 0)
    assert activations([2, 0], 0) == block.activations


def test_a_ranks_plan_runs_over_its_model_chunks_in_chunk_order():
    plan = RecomputeConfig(num_layers_per_stage=[3, 1])
    assert chunk_recompute(plan, 0, [2, 2]) == [RecomputeConfig("full", "block", 2),
                                                RecomputeConfig("full", "block", 1)]
    assert chunk_recompute(plan, 1, [2, 2]) == [RecomputeConfig("full", "block", 1),
                                                RecomputeConfig()]
    uniform = RecomputeConfig("full", "uniform", 1)
    assert chunk_recompute(uniform, 1, [2, 2]) == [uniform, uniform]


def test_interleaved_recomputes_per_stage_without_changing_the_weights():
    def config(plan):
        c = tiny_config(p=2, schedule="interleaved", optimizer="adam", lr=0.01, layers=8)
        c.parallel.virtual_pipeline_parallel = 2
        c.recompute = RecomputeConfig(num_layers_per_stage=plan)
        return c
    plain = sorted(run_ranks(2, _train, config(None), 2), key=lambda r: r["coords"][2])
    recomputed = sorted(run_ranks(2, _train, config([3, 0]), 2), key=lambda r: r["coords"][2])
    a, b = full_weights(plain), full_weights(recomputed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert recomputed[0]["peak_activations"] < 0.85 * plain[0]["peak_activations"]
    assert recomputed[1]["peak_activations"] == plain[1]["peak_activations"]
