"""PipeDream-2BW against the per-stage delay reference (tests/pipeline/reference.py) in layouts
beyond p = 2: four stages with real tensors (SGD and Adam), full recomputation (the version a
microbatch's forward read is what its recomputation reads), and the distributed optimizer
(ZeRO-1) in bf16. Each also lands measurably far from vanilla training."""
import functools

import pytest

from megatron_2bw.config import PrecisionConfig, RecomputeConfig
from megatron_2bw.distributed.layout import ParallelLayout
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, gpt_feed, max_difference, tiny_config, train_on_ranks
from tests.pipeline.precision_harness import train_stage
from tests.pipeline.reference import per_stage_delay_reference

VOCAB = 101
BATCHES = 5


def config(optimizer: str, **kwargs):
    return tiny_config(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 0.01, clip=0.5,
                       **kwargs)


@functools.lru_cache(maxsize=None)
def reference(rule: str, optimizer: str):
    c = config(optimizer)
    return per_stage_delay_reference(c, BATCHES, gpt_feed(c, ParallelLayout(1, 1, 1)), 4, rule)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_2bw_at_four_stages_matches_the_reference(optimizer):
    weights = full_weights(run_ranks(4, train_on_ranks, config(optimizer, p=4, schedule="2bw"),
                                     BATCHES))
    assert max_difference(weights, reference("2bw", optimizer), VOCAB) < 1e-5
    assert max_difference(weights, reference("vanilla", optimizer), VOCAB) > 1e-4


def test_2bw_with_full_recomputation_matches_the_reference():
    c = config("sgd", p=2, schedule="2bw")
    c.recompute = RecomputeConfig(granularity="full", method="uniform", num_layers=1)
    weights = full_weights(run_ranks(2, train_on_ranks, c, BATCHES))
    assert max_difference(weights, reference("2bw", "sgd"), VOCAB) < 1e-5
    assert max_difference(weights, reference("vanilla", "sgd"), VOCAB) > 1e-4


def test_2bw_with_the_distributed_optimizer_in_bf16_matches_the_reference():
    """bf16 working weights and activations carry 8 significant bits, so each gradient is off by
    about 1e-2 of itself; with SGD at lr 0.3 and gradients clipped to norm 0.5 that moves a master
    weight by at most about 1.5e-3 per step, typically far less: 2e-3 bounds five steps here. A
    large learning rate spreads the rules apart (2BW and vanilla end about 1e-2 apart), so the
    comparison still tells them apart."""
    c = tiny_config(optimizer="sgd", lr=0.3, clip=0.5, p=2, schedule="2bw")
    c.parallel.use_distributed_optimizer = True
    c.precision = PrecisionConfig(bf16=True, accumulate_allreduce_grads_in_fp32=True)
    weights = full_weights(run_ranks(4, train_stage, c, BATCHES))  # p2 x d2, gathered shards
    fp32 = tiny_config(optimizer="sgd", lr=0.3, clip=0.5)
    feed = gpt_feed(fp32, ParallelLayout(1, 1, 1))
    error = max_difference(weights, per_stage_delay_reference(fp32, BATCHES, feed, 4, "2bw"), VOCAB)
    apart = max_difference(weights, per_stage_delay_reference(fp32, BATCHES, feed, 4, "vanilla"),
                           VOCAB)
    assert error < 2e-3 and apart > 5e-3, (error, apart)
