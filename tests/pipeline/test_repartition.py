"""Live layer migration changes where a layer runs, never the arithmetic: a run that moves layers
after 2 of 4 batches ends with the weights and losses, bit for bit (fp32), of the same run started
with the final split (Flush, 2BW and PipeDream; t = 2; d = 2 with the distributed optimizer), and a
checkpoint saved after the move loads at another layout. (PipeDream with vertical sync: every stage
reads the same version; without it a layer's staleness depends on its stage, and repartitioning is
refused.) The decision logic on measured costs."""
import pytest
import torch

from megatron_2bw.checkpoint.reshard import read_full_state, write_full_state
from megatron_2bw.checkpoint.save_load import load_checkpoint, save_checkpoint
from megatron_2bw.config import RecomputeConfig
from megatron_2bw.pipeline.layer_times import StageTimes
from megatron_2bw.pipeline.repartition import decide, measured_costs, migrate, with_plan
from megatron_2bw.planner.stage_plan import LayerCosts
from megatron_2bw.training.segments import run_segment
from megatron_2bw.training.stage import build_stage
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, gpt_feed, rank_weights, stage_on_rank, tiny_config

BATCHES, MOVE_AT = 4, 2
VOCAB = 101


def _train(rank, world, config, split=None, recompute=None, save_dir=None):
    """BATCHES batches; with `split`, the layers move to it after MOVE_AT of them."""
    results = []
    layout, stage = stage_on_rank(rank, world, config, on_step=results.append)
    feed = gpt_feed(config, layout)
    if split is not None:
        run_segment(stage, 0, MOVE_AT, feed)
        stage.iteration = MOVE_AT
        stage = migrate(stage, split, recompute,
                        lambda c: build_stage(c, layout, torch.device("cpu"), None,
                                              on_step=results.append))
    run_segment(stage, stage.iteration, BATCHES - stage.iteration, feed)
    stage.iteration = BATCHES
    if save_dir is not None:
        stage.config.checkpoint.save = save_dir
        save_checkpoint(stage)
    return {**_full_master_weights(layout, stage), "split": stage.config.parallel.layer_split,
            "results": [(r.batch, r.metrics) for r in results]}


def _full_master_weights(layout, stage):
    """rank_weights with the distributed optimizer's shards gathered (collective)."""
    weights = rank_weights(layout, stage)
    full = stage.versions.full_master()
    weights["weights"] = {name: (tensor.detach().clone(), spec) for (name, (_, spec)), tensor
                          in zip(weights["weights"].items(), full)}
    return weights


def _losses(results):
    """(batch, metrics) of the last stage's steps."""
    return sorted((x[0], x[-1]) for r in results for x in r["results"] if x[-1])


CASES = {  # name: (config kwargs, world, split before, split after, recompute after)
    "2bw": (dict(p=2, schedule="2bw"), 2, [3, 1], [2, 2], [0, 0]),
    "flush-t2-recompute": (dict(t=2, p=2, schedule="flush"), 4, [3, 1], [1, 3], [1, 2]),
    "2bw-d2-distributed-optimizer": (dict(p=2, schedule="2bw"), 4, [1, 3], [3, 1], [0, 0]),
    # Muon's momentum buffers move with their layers, consolidated from the ZeRO-1 shards
    "2bw-d2-distributed-optimizer-muon": (dict(p=2, schedule="2bw"), 4, [1, 3], [3, 1], [0, 0]),
    "pipedream-vertical-sync": (dict(p=2, schedule="pipedream",
                                     untie_embeddings_and_output_weights=True),
                                2, [3, 1], [1, 3], [0, 0]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_migrated_run_equals_the_final_split_from_the_start(case):
    kwargs, world, before, after, recompute = CASES[case]
    config = tiny_config(optimizer="muon" if "muon" in case else "adam", lr=0.01,
                         global_batch=8 if world == 2 else 16, **kwargs)
    config.parallel.layer_split = before
    config.parallel.use_distributed_optimizer = "distributed" in case
    config.parallel.vertical_sync = "vertical-sync" in case
    moved = run_ranks(world, _train, config, after, recompute)
    reference = run_ranks(world, _train, with_plan(config, after, recompute))
    a, b = full_weights(moved), full_weights(reference)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), case
    assert _losses(moved) == _losses(reference)
    assert {batch for batch, _ in _losses(moved)} == set(range(BATCHES))
    assert all(r["split"] == after for r in moved)


def _load_at_one_stage(rank, world, config, root):
    layout, stage = stage_on_rank(rank, world, config)
    load_checkpoint(stage, root)
    return rank_weights(layout, stage)


def test_a_checkpoint_after_a_migration_loads_at_another_layout(tmp_path):
    config = tiny_config(optimizer="adam", lr=0.01, p=2, schedule="2bw")
    config.parallel.layer_split = [3, 1]
    moved = full_weights(run_ranks(2, _train, config, [1, 3], [0, 0], str(tmp_path / "a")))
    state = read_full_state(str(tmp_path / "a"), show_progress=False)
    assert state.config.parallel.layer_split == [1, 3] and state.iteration == BATCHES
    write_full_state(state, str(tmp_path / "b"), tensor=2, pipeline=1)
    single = tiny_config(optimizer="adam", lr=0.01, t=2, schedule="2bw")
    loaded = full_weights(run_ranks(2, _load_at_one_stage, single, str(tmp_path / "b")))
    for name, tensor in moved.items():
        if not name.startswith("tied_copy:"):
            rows = min(len(tensor), VOCAB)  # vocabulary rows: the padding depends on t
            same = loaded[name].shape == tensor.shape or torch.equal(loaded[name][:rows],
                                                                     tensor[:rows])
            assert same and (loaded[name].shape != tensor.shape or torch.equal(loaded[name],
                                                                               tensor)), name


def test_decide_moves_layers_off_the_slow_stage_only_past_the_threshold():
    config = tiny_config(p=2, layers=4)
    config.parallel.layer_split = [3, 1]
    even = LayerCosts.uniform(4, 1.0, 2.0, 1.0)
    decision = decide(config, even, 10)
    assert decision.proposed.split in ((2, 2), (1, 3)) and decision.gain == pytest.approx(0.5)
    # layer 3 (on stage 1) grows heavy: 3,1 is now the best split
    heavy = LayerCosts((1.0, 1.0, 1.0, 3.0), (2.0, 2.0, 2.0, 6.0), (1.0, 1.0, 1.0, 3.0))
    assert not decide(config, heavy, 10).changes()
    # a memory bound that lets stage 0 stash one layer only: recompute the other
    config.parallel.layer_split = [1, 3]
    config.recompute = RecomputeConfig(num_layers_per_stage=[0, 0])
    bounded = decide(config, even, 10, lambda stage, n: max(0, n - 1) if stage == 0 else 0)
    assert bounded.proposed.split == (2, 2) and bounded.proposed.recompute == (1, 0)


def test_measured_costs_take_recomputation_out_of_the_backward():
    config = tiny_config(p=2, layers=4)
    config.parallel.layer_split = [3, 1]
    config.recompute = RecomputeConfig(num_layers_per_stage=[1, 0])
    stage0 = StageTimes({0: 1.0, 1: 1.0, 2: 1.0}, {0: 3.0, 1: 2.0, 2: 2.0}, 4.0, 2)
    stage1 = StageTimes({3: 3.0}, {3: 6.0}, 3.0, 2)
    costs = measured_costs(config, [stage0, stage1])
    assert costs.forward_s == (1.0, 1.0, 1.0, 3.0)
    assert costs.backward_s == (2.0, 2.0, 2.0, 6.0)
    assert costs.first_extra_s == pytest.approx(3.0) and costs.last_extra_s == 0.0
