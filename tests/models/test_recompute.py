"""Activation recomputation replays dropout exactly (the default generator and the tensor-parallel
tracker), so gradients equal those of the run without it; it really recomputes, and full
recomputation keeps fewer activations."""
import torch

from megatron_2bw.config import ModelConfig, RecomputeConfig
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.memory import MemoryTracker
from megatron_2bw.models import build_stage_model
from megatron_2bw.tensor_parallel.random import seed_everything
from tests.distributed_helpers import run_ranks

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=101, make_vocab_size_divisible_by=8, hidden_dropout=0.1,
                    attention_dropout=0.1)
POLICIES = {
    "none": RecomputeConfig(),
    "full-uniform-1": RecomputeConfig("full", "uniform", 1),
    "full-uniform-2": RecomputeConfig("full", "uniform", 2),
    "full-block-3": RecomputeConfig("full", "block", 3),
    "selective": RecomputeConfig("selective"),
}


def run_policy(recompute: RecomputeConfig, group, t: int, tp_rank: int) -> dict:
    """Two training microbatches; gradients, losses, saved activation bytes and layer calls."""
    seed_everything(1234, tp_rank, 0)
    model = build_stage_model(MODEL, group, t, range(MODEL.num_layers), True, True, 1234, recompute)
    calls = [0]
    # a pre-hook: torch stops a recomputation once it has what backward needs, before the end
    model.transformer.layers["1"].register_forward_pre_hook(
        lambda *args: calls.__setitem__(0, calls[0] + 1))
    tracker = MemoryTracker(torch.device("cpu"))
    tokens = torch.randint(0, MODEL.vocab_size, (2, 2, MODEL.seq_length + 1),
                           generator=torch.Generator().manual_seed(5))
    losses = []
    for k in range(2):
        with tracker.track(k):
            loss, _ = model(None, {"tokens": tokens[k]})
        loss.backward()
        tracker.release(k)
        losses.append(loss.item())
    return {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "losses": losses,
            "activation_bytes": tracker.peak_activation_bytes, "layer_calls": calls[0]}


def compare_policies(group=None, t: int = 1, tp_rank: int = 0) -> dict:
    runs = {name: run_policy(policy, group, t, tp_rank) for name, policy in POLICIES.items()}
    base = runs["none"]
    return {name: {"grad_diff": max((r["grads"][n] - g).abs().max().item()
                                    for n, g in base["grads"].items()),
                   "loss_diff": max(abs(a - b) for a, b in zip(r["losses"], base["losses"])),
                   "activation_bytes": r["activation_bytes"], "layer_calls": r["layer_calls"]}
            for name, r in runs.items()}


def check(report: dict) -> None:
    for name, r in report.items():
        assert r["grad_diff"] <= 1e-6 and r["loss_diff"] <= 1e-6, (name, r)
    kept = {name: r["activation_bytes"] for name, r in report.items()}
    assert kept["full-uniform-2"] < kept["full-uniform-1"] < kept["selective"] < kept["none"]
    assert kept["full-uniform-1"] < kept["full-block-3"] < kept["none"]
    # layer 1 runs once per microbatch, twice when its chunk is recomputed
    calls = {name: r["layer_calls"] for name, r in report.items()}
    assert calls == {"none": 2, "full-uniform-1": 4, "full-uniform-2": 4, "full-block-3": 4,
                     "selective": 2}, calls


def test_dropout_is_on_and_varies():
    model = build_stage_model(MODEL, None, 1, range(MODEL.num_layers), True, True, 1234)
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_length + 1))
    first, second = model(None, {"tokens": tokens})[0], model(None, {"tokens": tokens})[0]
    assert first.item() != second.item()


def test_recomputation_gives_the_same_gradients_and_keeps_less():
    check(compare_policies())


def _tensor_parallel(rank, world):
    layout = ParallelLayout(world, world, 1, rank)
    layout.build_groups(1.0)
    return compare_policies(layout.group("tensor"), world, rank)


def test_recomputation_under_tensor_parallelism():
    for report in run_ranks(2, _tensor_parallel):
        check(report)
