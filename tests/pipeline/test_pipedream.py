"""PipeDream (weight stashing) and its vertical sync through the real stage machinery on gloo ranks,
against the per-stage delay reference (tests/pipeline/reference.py), fp32, dropout 0:
- p = 2 and p = 4 with one microbatch per update (PipeDream's own setting, m < p), SGD and Adam,
  each stage clipping by its own norm; the result is far from 2BW's and vanilla's rules;
- m = 2 microbatches accumulated per update; t2 x p2; p2 x d2;
- vertical sync at p = 4 (uniform delay p - 1) with the global clipping norm;
- full recomputation, the distributed optimizer, bf16 and fp16 (static scale; dynamic with
  vertical sync);
- the first stage's stash at p = 4 (p versions) against the memory estimate, and 2BW's."""
import functools

import pytest

from megatron_2bw.config import PrecisionConfig, RecomputeConfig
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.memory import static_breakdown
from megatron_2bw.planner.memory import estimate_stage_memory
from megatron_2bw.training.segments import run_segment
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import (full_weights, gpt_feed, max_difference, stage_on_rank,
                                    tiny_config, train_on_ranks)
from tests.pipeline.precision_harness import train_stage
from tests.pipeline.reference import per_stage_delay_reference

VOCAB = 101
BATCHES = 6


def config(optimizer: str, p: int, micro: int = 2, global_batch: int = 2, **kwargs):
    return tiny_config(p=p, global_batch=global_batch, micro=micro, optimizer=optimizer,
                       lr=0.05 if optimizer == "sgd" else 0.01, clip=0.5,
                       untie_embeddings_and_output_weights=True, **kwargs)


@functools.lru_cache(maxsize=None)
def reference(rule: str, optimizer: str, p: int, clip: str = "global"):
    """Each update one microbatch of the batch's 2 samples: the mean loss of every layout's
    batch (m microbatches of 2/(m d) samples on d replicas, averaged)."""
    c = config(optimizer, 1)
    return per_stage_delay_reference(c, BATCHES, gpt_feed(c, ParallelLayout(1, 1, 1)), 1, rule,
                                     p, clip=clip)


def run(world: int, c) -> dict:
    return full_weights(run_ranks(world, train_on_ranks, c, BATCHES))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("p", [2, 4])
def test_pipedream_matches_the_per_stage_delay_reference(optimizer, p):
    c = config(optimizer, p, schedule="pipedream")
    weights = run(p, c)
    assert max_difference(weights, reference("pipedream", optimizer, p, "stage"), VOCAB) < 1e-5
    # measurably another trajectory than 2BW's rule, vanilla training and vertical sync
    for rule in ("2bw", "vanilla", "pipedream-vs"):
        other = reference(rule, optimizer, p, "stage")
        assert max_difference(weights, other, VOCAB) > 1e-4, rule


@pytest.mark.parametrize("t,p,world,micro,optimizer", [
    (1, 2, 2, 1, "adam"),  # m = 2 microbatches accumulated per update
    (2, 2, 4, 2, "sgd"),  # t2 x p2
    (1, 2, 4, 1, "adam"),  # p2 x d2: two replicas of one microbatch each
], ids=["p2-m2", "t2-p2", "p2-d2"])
def test_pipedream_layouts_match_the_reference(t, p, world, micro, optimizer):
    c = config(optimizer, p, micro=micro, t=t, schedule="pipedream")
    weights = run(world, c)
    assert max_difference(weights, reference("pipedream", optimizer, p, "stage"), VOCAB) < 1e-5


def test_vertical_sync_matches_the_uniform_delay_reference():
    c = config("adam", 4, schedule="pipedream")
    c.parallel.vertical_sync = True
    weights = run(4, c)
    assert max_difference(weights, reference("pipedream-vs", "adam", 4), VOCAB) < 1e-5
    assert max_difference(weights, reference("pipedream", "adam", 4, "stage"), VOCAB) > 1e-4


def high_rate(p: int, micro: int = 2, **kwargs):
    """SGD at lr 0.3: the rules end about 1e-2 apart, well beyond half precision's error."""
    return tiny_config(p=p, global_batch=2, micro=micro, optimizer="sgd", lr=0.3, clip=0.5,
                       untie_embeddings_and_output_weights=True, **kwargs)


@functools.lru_cache(maxsize=None)
def high_rate_reference(rule: str, p: int, clip: str):
    c = high_rate(1)
    return per_stage_delay_reference(c, BATCHES, gpt_feed(c, ParallelLayout(1, 1, 1)), 1, rule, p,
                                     clip=clip)


def test_pipedream_recomputation_reads_the_stashed_version():
    c = config("sgd", 2, schedule="pipedream")
    c.recompute = RecomputeConfig(granularity="full", method="uniform", num_layers=1)
    assert max_difference(run(2, c), reference("pipedream", "sgd", 2, "stage"), VOCAB) < 1e-5


def test_pipedream_with_the_distributed_optimizer_matches_the_reference():
    c = config("adam", 2, micro=1, schedule="pipedream")
    c.parallel.use_distributed_optimizer = True  # p2 x d2: each replica steps half the weights
    weights = full_weights(run_ranks(4, train_stage, c, BATCHES))
    assert max_difference(weights, reference("pipedream", "adam", 2, "stage"), VOCAB) < 1e-5


@pytest.mark.parametrize("precision,vertical_sync,world", [
    ("bf16", False, 4),  # bf16 with fp32 accumulation and ZeRO-1, p2 x d2
    ("fp16", True, 2),  # dynamic loss scale: vertical sync decides every step globally
    ("fp16", False, 2),  # a static loss scale: each stage steps on its own
], ids=["bf16-zero1", "fp16-vertical-sync", "fp16-static-scale"])
def test_pipedream_in_half_precision_follows_its_rule(precision, vertical_sync, world):
    """Within half precision's error of the fp32 reference (see test_2bw_reference.py for the
    bound), and far from the other rules."""
    c = high_rate(2, micro=2 * 2 // world, schedule="pipedream")
    c.parallel.vertical_sync = vertical_sync
    c.parallel.use_distributed_optimizer = world > 2
    if precision == "bf16":
        c.precision = PrecisionConfig(bf16=True, accumulate_allreduce_grads_in_fp32=True)
    else:
        c.precision = PrecisionConfig(fp16=True, initial_loss_scale=2.0 ** 12,
                                      loss_scale=None if vertical_sync else 2.0 ** 12)
    results = run_ranks(world, train_stage, c, BATCHES)
    assert not any(skipped for r in results for _, skipped, *_ in r["results"])
    weights = full_weights(results)
    rule, clip = ("pipedream-vs", "global") if vertical_sync else ("pipedream", "stage")
    error = max_difference(weights, high_rate_reference(rule, 2, clip), VOCAB)
    apart = min(max_difference(weights, high_rate_reference(other, 2, clip), VOCAB)
                for other in ("vanilla", "pipedream" if vertical_sync else "pipedream-vs"))
    assert error < 2e-3 and apart > 5e-3, (error, apart)


def stash_on_rank(rank: int, world: int, c, batches: int) -> dict:
    """The stage's weight-version stash after `batches` batches, held and estimated."""
    layout, stage = stage_on_rank(rank, world, c)
    run_segment(stage, 0, batches, gpt_feed(c, layout))
    estimate = estimate_stage_memory(c.model, c.parallel, c.precision, c.recompute,
                                     c.optimizer.optimizer, c.training.micro_batch_size,
                                     stage.microbatches, layout.data, layout.stage)
    return {"stage": layout.stage, "live": stage.versions.distinct_versions,
            "held": static_breakdown(stage.versions, stage.optimizer)["versions_stash"],
            "estimated": estimate.versions_stash}


def test_stage_zero_stash_at_four_stages_matches_the_estimate():
    """PipeDream's first stage holds p = 4 versions, 3 beyond the working copy; 2BW's one."""
    stashes = {}
    for schedule, global_batch in (("pipedream", 2), ("2bw", 8)):
        c = config("adam", 4, global_batch=global_batch, schedule=schedule)
        ranks = run_ranks(4, stash_on_rank, c, 5)
        stashes[schedule] = next(r for r in ranks if r["stage"] == 0)
        for r in ranks:
            assert abs(r["held"] - r["estimated"]) <= 0.1 * max(r["estimated"], 1), (schedule, r)
    pipedream, two_bw = stashes["pipedream"], stashes["2bw"]
    assert pipedream["live"] == 4 and two_bw["live"] == 2
    assert 2.9 * two_bw["held"] < pipedream["held"] < 3.1 * two_bw["held"]


def test_one_stage_pipedream_is_vanilla_training():
    """p = 1: no delay (the rule gives version k), so Flush's weights, bit for bit."""
    c = config("adam", 1, schedule="pipedream")
    flushed = config("adam", 1, schedule="flush")
    assert max_difference(run(1, c), run(1, flushed), VOCAB) == 0.0
