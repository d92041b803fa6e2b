"""--use-distributed-optimizer: the flat layout's shards, the same weights as the unsharded run
(fp32) with half the optimizer state and master weights per rank for d=2, and a consolidated
state that restores training exactly."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.pipeline.flat_layout import FlatLayout
from megatron_2bw.training.segments import run_segment
from megatron_2bw.training.stage import build_stage
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, gpt_feed, max_difference
from tests.pipeline.precision_harness import precise_config, train_stage, with_changes

VOCAB = 101


def test_flat_layout_shards_tile_every_parameter_once():
    numels, tied = [5, 12, 7, 3], [False, True, False, False]
    layout = FlatLayout.build(numels, tied, alignment=4)
    assert layout.offsets[1] == 0 and layout.regions == ((0, 12), (12, 28))  # tied first, padded
    for d in (1, 2, 4):
        shards = [FlatLayout(layout.offsets, layout.numels, layout.regions, d, r) for r in range(d)]
        assert all(s.shard_numel * d == layout.total for s in shards)
        for i, n in enumerate(numels):
            parts = sorted((s.owned_part(i).lo, s.owned_part(i).hi) for s in shards)
            covered = [x for lo, hi in parts for x in range(lo, hi)]
            assert covered == list(range(n))  # each element owned by exactly one rank
        full = torch.arange(layout.total, dtype=torch.float32)
        pieces = [torch.cat([full[a:b] for a, b in s.owned]) for s in shards]
        assert torch.equal(shards[-1].unshard(pieces), full)
        for s, piece in zip(shards, pieces):  # position: where a parameter's part sits in the shard
            for i in range(len(numels)):
                part = s.owned_part(i)
                expected = full[layout.offsets[i] + part.lo:layout.offsets[i] + part.hi]
                assert torch.equal(piece[part.position:part.position + part.numel], expected)


@pytest.mark.parametrize("precision,p,schedule,clip", [
    ("fp32", 2, "2bw", 0.5),  # master weights part of the newest version, two versions, tied
    ("fp32", 1, "flush", 0.5),  # master weights = working weights: the shard is a view
    # fp16 working copies gathered from fp32 shards. No clipping: a shard-wise norm is summed in
    # another order, and fp16 rounding of the next version would magnify that last-bit difference
    ("fp16", 1, "flush", 0.0),
    # bf16 2BW: the master-gradient shard lives in the free working copy
    ("bf16", 2, "2bw", 0.0)])
def test_sharded_optimizer_matches_the_unsharded_run(precision, p, schedule, clip):
    config = precise_config(precision, p=p, schedule=schedule, optimizer="adam", lr=0.01, clip=clip)
    sharded_config = with_changes(config, parallel={"use_distributed_optimizer": True})
    plain, sharded = (run_ranks(2 * p, train_stage, c, 4) for c in (config, sharded_config))
    assert max_difference(full_weights(plain), full_weights(sharded), VOCAB) < 1e-6
    for a, b in zip(plain, sharded):
        assert a["coords"] == b["coords"]
        assert [r[2] for r in a["results"]] == pytest.approx([r[2] for r in b["results"]], rel=1e-5)
        assert a["optimizer_bytes"] == 2 * b["optimizer_bytes"]  # Adam's m and v: halved
        static_saved = a["static_bytes"] - b["static_bytes"]
        # also halved: the master weights and their gradients, where they are separate tensors.
        # In fp32 the master weights are (part of) a working copy, Flush's one or 2BW's newest,
        # sharded or not; the master gradients are separate under 2BW and where the buffer is
        # not fp32 (fp16's), else they are the buffer's owned part; sharded under 2BW with
        # fp16/bf16 weights they live in the free working copy (all 4 bytes saved)
        separate_master = precision != "fp32"
        separate_grads = schedule == "2bw" or precision == "fp16"
        in_free_copy = schedule == "2bw" and separate_master
        expected = (8 + 4 * separate_master + 4 * separate_grads) * a["parameters"] // 2 + \
            4 * in_free_copy * a["parameters"] // 2
        assert abs(static_saved - expected) <= 0.01 * expected


def _resume(rank, world, directory):
    """Train 2 batches sharded, save the consolidated state, restore it into a fresh stage and
    train 2 more; compare with 4 uninterrupted batches."""
    config = precise_config("fp32", p=1, schedule="2bw", optimizer="adam", lr=0.01, clip=0.5)
    config.parallel.use_distributed_optimizer = True
    layout = ParallelLayout(world, 1, 1, rank)
    layout.build_groups(1.0)
    feed = gpt_feed(config, layout)
    stage = build_stage(config, layout, torch.device("cpu"), None)
    run_segment(stage, 0, 2, feed)
    stage.optimizer.consolidate_state_dict(to=0)
    master = stage.versions.full_master(dst=0)
    if rank == 0:
        state = stage.optimizer.state_dict()
        index_of = {id(m): i for i, m in enumerate(stage.versions.master)}
        order = [index_of[id(p)] for g in stage.optimizer.param_groups for p in g["params"]]
        for position, entry in state["state"].items():  # full-size, as an unsharded optimizer's
            assert entry["exp_avg"].shape == master[order[position]].shape
        torch.save({"optimizer": state, "master": master,
                    "versions": {v: [t.detach().clone() for t in leaves]
                                 for v, leaves in stage.versions.versions.items()}},
                   os.path.join(directory, "state.pt"))
    dist.barrier()
    saved = torch.load(os.path.join(directory, "state.pt"), weights_only=False)
    resumed = build_stage(config, layout, torch.device("cpu"), None)
    resumed.versions.load_full_master(saved["master"])
    resumed.versions.reset(2, saved["versions"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    for s in (stage, resumed):
        run_segment(s, 2, 2, feed)
    return [max((a - b).abs().max().item() for a, b in zip(s.versions.full_master(), master))
            for s, master in [(resumed, stage.versions.full_master())]][0]


def test_consolidated_state_resumes_exactly(tmp_path):
    assert run_ranks(2, _resume, str(tmp_path)) == [0.0, 0.0]
