"""--optimizer muon across layouts: tensor parallelism and the distributed optimizer orthogonalise
each matrix whole (optim/muon.WholeMatrices), so t=2, d=2 with ZeRO-1 and p=2 under 2BW train the
same weights as one process; orthogonalising each tensor-parallel shard by itself would not.

Newton-Schulz runs in bf16 (as torch.optim.Muon): a last-bit difference of the fp32 update (the
layouts sum gradients in other orders) can round a bf16 input element the other way, and four
steps grow that to about 1e-3. So the layouts are compared exactly with NS computed in float64
(the same iteration), and with the real bf16 NS within a bound ten times below the error of
orthogonalising shards."""
import pytest
import torch

import megatron_2bw.optim.muon as muon
from megatron_2bw.optim.muon import WholeMatrices
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, max_difference
from tests.pipeline.precision_harness import precise_config, train_stage, with_changes

VOCAB = 101
BATCHES = 4
BF16_NEWTON_SCHULZ = muon.newton_schulz


def muon_config(t=1, p=1, schedule="flush", zero=False, precision="fp32", clip=0.0):
    config = precise_config(precision, t=t, p=p, schedule=schedule, optimizer="muon", lr=0.02,
                            clip=clip)
    return with_changes(config, parallel={"use_distributed_optimizer": zero})


def trained(config, world, before=None):
    ranks = run_ranks(world, train_stage, config, BATCHES, before)
    # the planner's estimate: Muon's buffers and AdamW's moments; sharded, a bound on each rank
    sharded = config.parallel.use_distributed_optimizer
    for rank in ranks:
        if sharded:
            assert rank["optimizer_bytes"] <= rank["estimate"]["optimizer"]
        else:
            assert rank["optimizer_bytes"] == rank["estimate"]["optimizer"]
    if sharded:  # the replicas' shards add up to the unsharded state
        unsharded = run_ranks(world // 2, train_stage, with_changes(
            config, parallel={"use_distributed_optimizer": False}), 0)
        by_coords = {r["coords"][0::2]: r["optimizer_bytes"] for r in unsharded}
        totals = {}
        for rank in ranks:
            key = rank["coords"][0::2]
            totals[key] = totals.get(key, 0) + rank["optimizer_bytes"]
        assert totals == by_coords
    return full_weights(ranks)


def blockwise(stage):
    """Orthogonalise each rank's shard by itself (what the whole-matrix gather prevents)."""
    stage.optimizer.whole_matrices = WholeMatrices()


def newton_schulz_float64(update, steps, coefficients=muon.NS_COEFFICIENTS, eps=muon.NS_EPS):
    a, b, c = coefficients
    x = update.double()
    tall = update.size(0) > update.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


@pytest.fixture(scope="module")
def exact_ns():
    """The ranks fork from this process, so they run the patched iteration too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(muon, "newton_schulz", newton_schulz_float64)
        yield


@pytest.fixture(scope="module")
def one_process(exact_ns):
    return {schedule: trained(muon_config(schedule=schedule), 1) for schedule in ("flush", "2bw")}


@pytest.mark.parametrize("layout,world", [
    (dict(t=2), 2),
    (dict(zero=True), 2),
    (dict(p=2, schedule="2bw"), 2),
    (dict(t=2, zero=True, schedule="2bw"), 4)])
def test_parallel_layouts_match_one_process(one_process, layout, world):
    config = muon_config(**layout)
    reference = one_process[config.parallel.schedule]
    assert max_difference(trained(config, world), reference, VOCAB) < 2e-6


def test_orthogonalising_each_shard_would_differ(one_process):
    shards = trained(muon_config(t=2), 2, before=blockwise)
    assert max_difference(shards, one_process["flush"], VOCAB) > 1e-2


def test_with_the_bf16_iteration_tensor_parallel_stays_near_one_process(monkeypatch):
    monkeypatch.setattr(muon, "newton_schulz", BF16_NEWTON_SCHULZ)  # whatever ran before
    reference, t2 = trained(muon_config(), 1), trained(muon_config(t=2), 2)
    assert max_difference(t2, reference, VOCAB) < 5e-3


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_keeps_fp32_master_weights_and_state_and_trains_like_fp32(precision,
                                                                                 monkeypatch):
    monkeypatch.setattr(muon, "newton_schulz", BF16_NEWTON_SCHULZ)
    fp32 = run_ranks(2, train_stage, muon_config(p=2, schedule="2bw", clip=0.5), BATCHES)
    half = run_ranks(2, train_stage, muon_config(p=2, schedule="2bw", precision=precision,
                                                 clip=0.5), BATCHES)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    for a, b in zip(fp32, half):
        assert b["working_dtype"] == dtype
        assert all(w.dtype == torch.float32 for w, _ in b["weights"].values())
        # Muon's momentum buffers and AdamW's moments: fp32, as many bytes as in fp32
        assert b["optimizer_bytes"] == a["optimizer_bytes"] == b["estimate"]["optimizer"]
        assert not any(skipped for _, skipped, *_ in b["results"])
    losses = [[r[4]["lm loss"] for r in ranks[1]["results"]] for ranks in (fp32, half)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
