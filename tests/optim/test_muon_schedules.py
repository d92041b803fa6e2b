"""--optimizer muon under every kind of schedule, against the tests' independent single-process
references of each update rule (which step torch's optimizer the same way): Flush and zero-bubble,
2BW, PipeDream's weight stashing, PipeMare (T1 + T2), and 2BW's delay compensation (predict, dc).
Newton-Schulz runs in float64 here (see test_muon_parallel.py) so the rules compare exactly."""
import pytest

import megatron_2bw.optim.muon as muon
from megatron_2bw.distributed.layout import ParallelLayout
from tests.distributed_helpers import run_ranks
from tests.optim.test_muon_parallel import newton_schulz_float64
from tests.pipeline.compensation_reference import compensated_reference
from tests.pipeline.harness import full_weights, gpt_feed, max_difference, tiny_config
from tests.pipeline.pipemare_reference import pipemare_reference
from tests.pipeline.precision_harness import train_stage
from tests.pipeline.reference import per_stage_delay_reference

VOCAB = 101
BATCHES = 5
DC_LAMBDA = 5000.0  # large enough that a missing correction shows


@pytest.fixture(autouse=True)
def exact_ns(monkeypatch):
    monkeypatch.setattr(muon, "newton_schulz", newton_schulz_float64)


def config(schedule, p=2, m=2, untied=False, **parallel):
    c = tiny_config(p=p, schedule=schedule if p > 1 else None, optimizer="muon", lr=0.02,
                    clip=0.5, global_batch=2 * m, untie_embeddings_and_output_weights=untied)
    for key, value in parallel.items():
        setattr(c.parallel, key, value)
    return c


def run(c, world=2):
    return full_weights(run_ranks(world, train_stage, c, BATCHES))


def rule_reference(rule, m=2, clip="global", untied=False):
    c = config(None, p=1, m=m, untied=untied)
    return per_stage_delay_reference(c, BATCHES, gpt_feed(c, ParallelLayout(1, 1, 1)), m, rule,
                                     2, clip=clip)


@pytest.mark.parametrize("schedule,rule,chunks", [
    ("flush", "vanilla", None), ("gpipe", "vanilla", None), ("zb-h1", "vanilla", None),
    ("interleaved", "vanilla", 2), ("2bw", "2bw", None)])
def test_synchronous_and_2bw_schedules_follow_their_rule(schedule, rule, chunks):
    weights = run(config(schedule, virtual_pipeline_parallel=chunks))
    assert max_difference(weights, rule_reference(rule), VOCAB) < 1e-5
    other = "2bw" if rule == "vanilla" else "vanilla"
    assert max_difference(weights, rule_reference(other), VOCAB) > 1e-4


@pytest.mark.parametrize("vertical_sync", [False, True], ids=["pipedream", "vertical-sync"])
def test_pipedream_weight_stashing_follows_its_rule(vertical_sync):
    weights = run(config("pipedream", m=1, untied=True, vertical_sync=vertical_sync))
    rule, clip = ("pipedream-vs", "global") if vertical_sync else ("pipedream", "stage")
    reference = rule_reference(rule, m=1, clip=clip, untied=True)
    assert max_difference(weights, reference, VOCAB) < 1e-5


def test_pipemare_follows_its_rule():
    c = config("pipemare", untied=True, pipemare_lr_warmup_iters=3,
               pipemare_discrepancy_decay=0.9)
    reference_config = config(None, p=1, untied=True)
    expected = pipemare_reference(reference_config, BATCHES,
                                  gpt_feed(reference_config, ParallelLayout(1, 1, 1)), 2, 2, 3, 0.9)
    assert max_difference(run(c), expected, VOCAB) < 1e-5


@pytest.mark.parametrize("mode", ["predict", "dc"])
def test_delay_compensation_follows_its_rule(mode):
    c = config("2bw", delay_compensation=mode,
               delay_compensation_lambda=DC_LAMBDA if mode == "dc" else None)
    reference_config = config(None, p=1)
    feed = gpt_feed(reference_config, ParallelLayout(1, 1, 1))
    expected = compensated_reference(reference_config, BATCHES, feed, 2, mode, coefficient=DC_LAMBDA)
    weights = run(c)
    assert max_difference(weights, expected, VOCAB) < 1e-5
    assert max_difference(weights, rule_reference("2bw"), VOCAB) > 1e-4
