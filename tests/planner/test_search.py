import dataclasses

import pytest

from megatron_2bw.config_checks import validate, validate_for_world
from megatron_2bw.config import Config, ModelConfig, ParallelConfig, PrecisionConfig, TrainingConfig
from megatron_2bw.planner.hardware import load_hardware
from megatron_2bw.planner.search import (SearchSpace, apply_plan, best_plan, candidates,
                                         rank_plans)

MODEL = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                    vocab_size=5000)
P3 = load_hardware("p3.16xlarge")


def test_candidates_respect_every_constraint():
    pool = candidates(MODEL, 16, P3.for_world(16), 32)
    assert {c.tensor_parallel for c in pool} == {1, 2, 4}  # divides the heads and 8 devices
    assert {c.pipeline_parallel for c in pool} == {1, 2, 4}  # p <= 4 layers
    for c in pool:
        assert c.tensor_parallel * c.pipeline_parallel * c.data_parallel == 16
        assert 32 % (c.micro_batch_size * c.data_parallel) == 0
        if c.schedule != "gpipe":
            assert c.microbatches(32) >= c.pipeline_parallel
    assert {c.schedule for c in pool if c.pipeline_parallel > 1} == {"2bw", "flush", "gpipe",
                                                                     "zb-h1", "interleaved"}
    for c in pool:  # interleaved: two chunks of whole layers, m in groups of p
        assert (c.chunks == 2) == (c.schedule == "interleaved")
        if c.schedule == "interleaved":
            assert c.microbatches(32) % c.pipeline_parallel == 0
            assert MODEL.num_layers % (2 * c.pipeline_parallel) == 0
    assert {c.schedule for c in pool if c.pipeline_parallel == 1} == {"flush"}
    assert {c.recompute for c in pool} == {None, "selective", "full"}
    pinned = candidates(MODEL, 16, P3, 32, SearchSpace(tensor_parallel=(2,), micro_batch_sizes=(1,),
                                                       schedules=("flush",), recompute=(None,)))
    assert {(c.tensor_parallel, c.micro_batch_size, c.schedule) for c in pinned} == {(2, 1, "flush")}
    one_stage = candidates(MODEL, 16, P3, 32,
                           SearchSpace(pipeline_parallel=(1,), schedules=("2bw",)))
    assert {c.schedule for c in one_stage} == {"2bw"}  # a pinned schedule is kept
    split = candidates(MODEL, 16, P3, 32, SearchSpace(layer_split=(1, 3)))
    assert {(c.pipeline_parallel, c.layer_split) for c in split} == {(2, (1, 3))}


def test_tensor_parallel_sizes_must_divide_the_query_groups():
    """Each rank holds whole query groups: with 2 groups for 4 heads, t = 4 is no candidate."""
    grouped = dataclasses.replace(MODEL, num_query_groups=2)
    assert {c.tensor_parallel for c in candidates(grouped, 16, P3.for_world(16), 32)} == {1, 2}
    assert rank_plans(grouped, 16, P3, 32, PrecisionConfig(fp16=True))[0].fits
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 4 must divide .* the 2 "
                                         "query groups"):
        rank_plans(grouped, 16, P3, 32, PrecisionConfig(), space=SearchSpace(tensor_parallel=(4,)))


def test_heads_of_any_size_split_as_the_heads_do():
    """--kv-channels: t divides the heads and the query groups (and so the attention's width)
    whatever the head size, the hidden size need not be a multiple of the heads, and every
    candidate's t passes the runtime's checks. Wider heads cost the same configuration more time
    and memory."""
    wide = dataclasses.replace(MODEL, kv_channels=128)  # 4 heads of 128: twice the hidden size
    uneven = dataclasses.replace(MODEL, num_attention_heads=6, kv_channels=64)  # 256 % 6 != 0
    for model, sizes in ((wide, {1, 2, 4}), (uneven, {1, 2})):
        assert {c.tensor_parallel for c in candidates(model, 16, P3.for_world(16), 32)} == sizes
        for t in sizes:
            validate(Config(model=model, parallel=ParallelConfig(tensor_parallel=t)),
                     require_data=False)
    space = SearchSpace(tensor_parallel=(2,), pipeline_parallel=(2,), micro_batch_sizes=(4,),
                        schedules=("2bw",), recompute=(None,))
    [plain] = rank_plans(MODEL, 8, P3, 32, PrecisionConfig(fp16=True), space=space)
    [wider] = rank_plans(wide, 8, P3, 32, PrecisionConfig(fp16=True), space=space)
    assert wider.candidate == plain.candidate and wider.fits
    assert wider.time_per_batch_s > plain.time_per_batch_s
    for plain_stage, wide_stage in zip(plain.stage_memory, wider.stage_memory):
        assert wide_stage.activations > plain_stage.activations
        assert wide_stage.params > plain_stage.params


def test_sequence_parallel_is_planned_as_given_and_needs_t_to_divide_the_sequence():
    """--sequence-parallel is not searched: every candidate keeps the model's setting, t must
    divide the sequence too, and a stage of the same candidate needs less memory with it."""
    sp = dataclasses.replace(MODEL, seq_length=126, max_position_embeddings=126,
                             sequence_parallel=True)
    assert {c.tensor_parallel for c in candidates(sp, 16, P3.for_world(16), 32)} == {1, 2}
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 4 must divide .*"
                                         r"--seq-length 126 \(--sequence-parallel\)"):
        rank_plans(sp, 16, P3, 32, PrecisionConfig(), space=SearchSpace(tensor_parallel=(4,)))
    space = SearchSpace(tensor_parallel=(2,), pipeline_parallel=(2,), micro_batch_sizes=(4,),
                        schedules=("2bw",), recompute=(None,))
    [plain] = rank_plans(MODEL, 8, P3, 32, PrecisionConfig(fp16=True), space=space)
    [split] = rank_plans(dataclasses.replace(MODEL, sequence_parallel=True), 8, P3, 32,
                         PrecisionConfig(fp16=True), space=space)
    assert split.candidate == plain.candidate
    for plain_stage, split_stage in zip(plain.stage_memory, split.stage_memory):
        assert split_stage.activations < plain_stage.activations
        assert split_stage.params == plain_stage.params


def test_replaying_only_the_contenders_finds_the_same_top():
    args = (MODEL, 16, P3, 64, PrecisionConfig(fp16=True))
    pruned = rank_plans(*args, simulate_top=2)
    exhaustive = rank_plans(*args, simulate_top=10 ** 6)
    assert sum(p.simulated for p in pruned) < sum(p.simulated for p in exhaustive)
    for schedule in ("2bw", "flush", "gpipe"):
        def top(plans):
            return [(p.candidate, round(p.throughput_samples_per_s, 9)) for p in plans
                    if p.candidate.schedule == schedule and p.simulated][:2]
        assert top(pruned) == top(exhaustive)
    assert pruned[0] == exhaustive[0]


def test_memory_limit_marks_and_ranks_configurations():
    plans = rank_plans(MODEL, 8, P3, 64, PrecisionConfig(fp16=True))
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True)  # every fitting configuration first
    for plan in plans:
        assert plan.fits == (max(plan.memory_bytes_per_stage) <= 0.95 * P3.usable_memory_bytes)
    replayed = [p.throughput_samples_per_s for p in plans if p.fits and p.simulated]
    assert replayed == sorted(replayed, reverse=True)
    tiny = dataclasses.replace(P3, memory_per_device_bytes=2 * 2**20, reserved_memory_bytes=0)
    squeezed = rank_plans(MODEL, 8, tiny, 64, PrecisionConfig(fp16=True))
    assert not any(p.fits for p in squeezed) and not any(p.simulated for p in squeezed)
    config = Config(model=MODEL, training=TrainingConfig(global_batch_size=64))
    with pytest.raises(ValueError, match="no configuration fits in 0.0 GiB"):
        best_plan(config, 8, tiny)


def test_best_plan_applies_to_a_config():
    config = Config(model=MODEL, training=TrainingConfig(global_batch_size=64))
    config.precision.fp16 = True
    config.parallel.auto_parallel, config.parallel.planner_hardware = True, "p3.16xlarge"
    config.parallel.bind_cores_to_rank, config.parallel.timeout_minutes = True, 3.0
    plan = best_plan(config, 8, P3)
    assert plan.fits and plan.simulated
    assert plan == rank_plans(MODEL, 8, P3, 64, PrecisionConfig(fp16=True))[0]
    applied = apply_plan(config, plan)
    c = plan.candidate
    assert (applied.parallel.tensor_parallel, applied.parallel.pipeline_parallel,
            applied.parallel.pipeline_schedule, applied.training.micro_batch_size) == \
        (c.tensor_parallel, c.pipeline_parallel, c.schedule, c.micro_batch_size)
    assert applied.parallel.layer_split == list(c.layer_split)
    assert applied.recompute.granularity == c.recompute
    assert validate_for_world(applied, 8) == c.data_parallel
    assert config.parallel.tensor_parallel == 1  # the original is untouched
    # every setting the plan does not choose is kept
    assert (applied.parallel.auto_parallel, applied.parallel.planner_hardware,
            applied.parallel.bind_cores_to_rank, applied.parallel.timeout_minutes) == \
        (True, "p3.16xlarge", True, 3.0)
    json_row = plan.to_json()
    assert {"tensor_parallel", "pipeline_parallel", "data_parallel", "micro_batch_size",
            "recompute", "schedule", "throughput_samples_per_s", "memory_bytes_per_stage", "fits",
            "bottleneck"} <= set(json_row)


def test_no_candidate_is_an_error():
    one_layer = dataclasses.replace(MODEL, num_layers=1, num_attention_heads=1)  # t = p = 1
    with pytest.raises(ValueError, match="no valid parallel configuration"):
        rank_plans(one_layer, 8, P3, 12, PrecisionConfig())  # d = 8 does not divide 12


def test_ranks_sharing_cores_slow_every_configuration_alike():
    """Four CPU ranks on two cores: each plan takes at least the node's summed compute over two
    cores and shows the time lost to sharing; with a core per rank the same plans are faster."""
    own_cores = dataclasses.replace(P3, devices_per_node=4, compute_slots_per_node=None)
    shared = dataclasses.replace(own_cores, compute_slots_per_node=2)
    space = SearchSpace(micro_batch_sizes=(4,), recompute=(None,), schedules=("2bw",))
    fast = {p.candidate.describe(): p for p in rank_plans(MODEL, 4, own_cores, 64,
                                                          PrecisionConfig(), space=space)}
    slow = rank_plans(MODEL, 4, shared, 64, PrecisionConfig(), space=space)
    for plan in slow:
        alone = fast[plan.candidate.describe()]
        assert plan.time_per_batch_s > alone.time_per_batch_s
        assert plan.breakdown["shared_cores"] > 0
    # four replicas of the whole model: each core runs two of them
    replicas = next(p for p in slow if p.candidate.data_parallel == 4)
    assert replicas.time_per_batch_s > 1.8 * fast[replicas.candidate.describe()].time_per_batch_s


def test_a_measured_search_keeps_to_the_micro_batch_sizes_it_profiled(monkeypatch):
    from megatron_2bw.planner import search
    profiled = []
    monkeypatch.setattr(search, "measured_profile_for",
                        lambda config, world, hardware, space, sizes, cache, progress=False:
                        profiled.append(list(sizes)) or "profile")
    config = Config(model=MODEL, training=TrainingConfig(global_batch_size=32))
    profile, space = search.measured_search(config, 2, P3, SearchSpace())
    # micro batch 16 would fit the batch, but is not measured: the search does not consider it
    assert profile == "profile" and profiled == [[1, 2, 4, 8]]
    assert space.micro_batch_sizes == (1, 2, 4, 8)
    assert {c.micro_batch_size for c in candidates(MODEL, 2, P3.for_world(2), 32, space)} <= \
        {1, 2, 4, 8}
    small = Config(model=MODEL, training=TrainingConfig(global_batch_size=2))
    assert search.measured_search(small, 2, P3, SearchSpace())[1].micro_batch_sizes == (1, 2)
    # a size the user typed is measured, whatever its size
    pinned = search.measured_search(config, 2, P3, SearchSpace(micro_batch_sizes=(16,)))[1]
    assert profiled[-1] == [16] and pinned.micro_batch_sizes == (16,)
    with pytest.raises(ValueError, match="--global-batch-size"):
        search.measured_search(Config(model=MODEL), 2, P3, SearchSpace())


@pytest.mark.parametrize("space,message", [
    (SearchSpace(micro_batch_sizes=(5,)), "--micro-batch-size 5 must divide a replica's batch "
                                          r"\(--global-batch-size 32 / d\)"),
    (SearchSpace(pipeline_parallel=(3,)), "--pipeline-model-parallel-size 3 must divide the world "
                                          "size 8"),
    (SearchSpace(tensor_parallel=(16,)), "--tensor-model-parallel-size 16 must divide the world "
                                         "size 8"),
    (SearchSpace(layer_split=(2, 1, 1)), "--pipeline-layer-split 2,1,1 gives 3 stages, which must "
                                         "divide the world size 8"),
])
def test_a_pinned_size_that_leaves_nothing_is_named(space, message):
    with pytest.raises(ValueError, match=message):
        rank_plans(MODEL, 8, P3, 32, PrecisionConfig(), space=space)
