"""The planner considers PipeDream beside 2BW, Flush and GPipe: for untied GPT models only, with
any number of microbatches, its p - s weight versions in the memory estimate and 2BW's
bubble-free time."""
import dataclasses

from megatron_2bw.config import ModelConfig, PrecisionConfig
from megatron_2bw.planner.hardware import load_hardware
from megatron_2bw.planner.search import SearchSpace, candidates, rank_plans

TIED = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                   vocab_size=5000)
UNTIED = dataclasses.replace(TIED, untie_embeddings_and_output_weights=True)
P3 = load_hardware("p3.16xlarge")


def test_pipedream_is_a_candidate_for_untied_models_even_with_m_below_p():
    untied = candidates(UNTIED, 16, P3.for_world(16), 32)
    pipedream = [c for c in untied if c.schedule == "pipedream"]
    assert pipedream and {c.schedule for c in untied if c.pipeline_parallel > 1} == \
        {"2bw", "flush", "gpipe", "pipedream"}
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
