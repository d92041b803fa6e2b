"""The planner considers PipeDream beside 2BW, Flush and GPipe: for untied GPT models only, with
any number of microbatches, its p - s weight versions in the memory estimate and 2BW's
bubble-free time."""
import dataclasses

import pytest

from megatron_2bw.config import ModelConfig, PrecisionConfig
from megatron_2bw.pipeline import schedules as S
from megatron_2bw.planner.cost import StageCost
from megatron_2bw.planner.hardware import load_hardware
from megatron_2bw.planner.search import SearchSpace, candidates, rank_plans
from megatron_2bw.planner.simulator import simulate

TIED = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                   vocab_size=5000)
UNTIED = dataclasses.replace(TIED, untie_embeddings_and_output_weights=True)
P3 = load_hardware("p3.16xlarge")


def test_pipedream_is_a_candidate_for_untied_models_even_with_m_below_p():
    untied = candidates(UNTIED, 16, P3.for_world(16), 32)
    pipedream = [c for c in untied if c.schedule == "pipedream"]
    assert pipedream and {c.schedule for c in untied if c.pipeline_parallel > 1} == \
        {"2bw", "flush", "gpipe", "pipedream", "zb-h1", "interleaved"}
    assert any(c.microbatches(32) < c.pipeline_parallel for c in pipedream)
    assert not [c for c in candidates(TIED, 16, P3.for_world(16), 32) if c.schedule == "pipedream"]


def test_pipedream_plans_hold_more_versions_at_2bw_speed():
    space = SearchSpace(tensor_parallel=(1,), pipeline_parallel=(4,), micro_batch_sizes=(2,),
                        recompute=(None,), schedules=("2bw", "pipedream"))
    plans = {p.candidate.schedule: p for p in rank_plans(UNTIED, 4, P3, 8, PrecisionConfig(),
                                                         space=space)}
    two_bw, pipedream = plans["2bw"], plans["pipedream"]
    assert pipedream.candidate.microbatches(8) == two_bw.candidate.microbatches(8) == 4
    stash = [m.versions_stash for m in pipedream.stage_memory]
    assert stash[0] == 3 * two_bw.stage_memory[0].versions_stash  # 4 versions against 2
    assert stash == sorted(stash, reverse=True) and stash[-1] == 0  # p - s - 1 extra copies
    # its steps wait for no other stage, but the last stage steps right after its reduce: within
    # 10% of 2BW, which defers the step into the next batch
    assert abs(pipedream.time_per_batch_s / two_bw.time_per_batch_s - 1) < 0.10


def test_global_step_decisions_stall_pipedream_but_not_its_vertical_sync():
    """Replayed with a step that waits for every stage's gradient norm: PipeDream's later stages
    would stall (they need version k+1 before the first stage's gradient of update k exists),
    which is why its steps are stage-local; vertical sync runs at 2BW's pace."""
    stages = [StageCost(1.0, 2.0, 0.0, 0.0, 0.0, 0.1, 0.1) for _ in range(4)]

    def time(schedule: str, local: bool = False) -> float:
        actions = S.build_schedule(schedule, 4, 4, 6)
        return simulate(actions, stages, stage_local_steps=local).time_per_batch
    two_bw = time("2bw")
    assert time("pipedream-vs") == pytest.approx(two_bw, rel=0.02)
    assert time("pipedream", local=True) == pytest.approx(two_bw, rel=0.05)
    assert time("pipedream") > 1.2 * two_bw
