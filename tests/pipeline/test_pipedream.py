"""PipeDream (weight stashing) and its vertical sync through the real stage machinery on gloo ranks,
against the per-stage delay reference (tests/pipeline/reference.py), fp32, dropout 0:
- p = 2 and p = 4 with one microbatch per update (PipeDream's own setting, m < p), SGD and Adam,
  each stage clipping by its own norm; the result is far from 2BW's and vanilla's rules;
- m = 2 microbatches accumulated per update; t2 x p2; p2 x d2;
- vertical sync at p = 4 (uniform delay p - 1) with the global clipping norm."""
import functools

import pytest

from megatron_2bw.distributed.layout import ParallelLayout
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, gpt_feed, max_difference, tiny_config, train_on_ranks
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
