"""Training on the device: bf16 on the GPU tracks fp32 on the CPU, the steady state never waits
for the device outside the optimizer step, recomputation and the RNG tracker replay dropout
exactly, and a checkpoint saved from device tensors resumes exactly."""
import dataclasses

import pytest
import torch

from megatron_2bw.checkpoint import load_checkpoint, save_checkpoint
from megatron_2bw.config import CheckpointConfig, PrecisionConfig, RecomputeConfig
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.pipeline.update import GradientUpdater
from megatron_2bw.training.segments import run_segment
from megatron_2bw.training.stage import build_stage
from tests.pipeline.harness import gpt_feed, tiny_config


def _stage(config, device):
    layout = ParallelLayout(1, 1, 1, 0)
    layout.build_groups(10.0)
    losses = []
    stage = build_stage(config, layout, device, None,
                        on_step=lambda r: losses.append(r.metrics["lm loss"]))
    return stage, layout, losses


def _on(device, feed):
    return lambda k: {key: value.to(device) for key, value in feed(k).items()}


def _config(**precision):
    config = tiny_config(p=1, layers=2, optimizer="adam", lr=1e-3, global_batch=8, micro=2,
                         hidden_size=64, seq_length=32)
    return dataclasses.replace(config, precision=PrecisionConfig(**precision))


def test_bf16_training_on_the_gpu_tracks_fp32_on_the_cpu(device):
    """20 steps: bf16 weights and activations (fp32 master weights and gradients) against fp32."""
    runs = []
    for config, where in ((_config(), torch.device("cpu")), (_config(bf16=True), device)):
        stage, layout, losses = _stage(config, where)
        run_segment(stage, 0, 20, _on(where, gpt_feed(config, layout)))
        runs.append(losses)
    cpu, gpu = runs
    assert len(cpu) == len(gpu) == 20
    # the fp32 reference learns, and bf16 on the device with it: within the steps' 3% its drop
    # can be smaller than the reference's
    assert cpu[-1] < cpu[0] - 0.5 and gpu[-1] < gpu[0] - 0.25
    for step, (a, b) in enumerate(zip(cpu, gpu)):
        assert b == pytest.approx(a, rel=0.03), (step, a, b)


def test_the_steady_state_never_waits_for_the_device_outside_the_step(device, monkeypatch):
    """torch.cuda.set_sync_debug_mode("error") over whole batches after warm-up: any
    synchronising call raises. The optimizer step reads the gradient norm and the batch's
    metrics (as Megatron-LM's step reads its norm), so it alone runs outside the check."""
    config = _config(bf16=True)
    config.model.hidden_dropout = config.model.attention_dropout = 0.1
    config.training.calculate_per_token_loss = True
    stage, layout, losses = _stage(config, device)
    feed = gpt_feed(config, layout)
    microbatches = [_on(device, feed)(k) for k in range(4 * 6)]  # on the device beforehand
    step = GradientUpdater.step

    def step_without_check(self, batch):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return step(self, batch)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    monkeypatch.setattr(GradientUpdater, "step", step_without_check)
    run_segment(stage, 0, 2, lambda k: microbatches[k])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_segment(stage, 2, 4, lambda k: microbatches[k])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(losses) == 6


@pytest.mark.parametrize("recompute", [RecomputeConfig("full", "uniform", 1),
                                       RecomputeConfig("selective")], ids=["full", "selective"])
def test_recomputation_replays_dropout_exactly_on_the_device(recompute, device):
    """With dropout on, recomputing in the backward (the default generator and the RNG
    tracker's tensor-parallel stream replayed) gives the gradients of keeping the activations."""
    from megatron_2bw.models import build_stage_model
    from megatron_2bw.tensor_parallel.random import seed_everything
    config = _config(bf16=True).model
    config.hidden_dropout = config.attention_dropout = 0.2
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length + 1), device=device)
    grads = []
    for policy in (None, recompute):
        seed_everything(7, 0, 0)
        model = build_stage_model(config, None, 1, range(2), True, True, 3, policy, device=device)
        model.train()
        loss, _ = model(None, {"tokens": tokens})
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, atol=1e-6, rtol=1e-5)


def test_the_rng_tracker_forks_the_device_generator(device):
    """The tracker's stream is its own: forking draws from it without moving the default CUDA
    generator, and reseeding gives the same draws again."""
    from megatron_2bw.tensor_parallel.random import get_rng_tracker, seed_everything
    draws = []
    for _ in range(2):
        seed_everything(11, 0, 0)
        before = torch.cuda.get_rng_state()
        with get_rng_tracker().fork():
            forked = torch.rand(8, device=device)
        assert torch.equal(torch.cuda.get_rng_state(), before)
        draws.append((forked, torch.rand(8, device=device)))
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
    assert not torch.equal(draws[0][0], draws[0][1])


def test_a_checkpoint_of_device_tensors_resumes_exactly(device, tmp_path):
    """Train 4 steps straight, or 2, save (from the device), load into a fresh stage and train 2
    more: the same losses and weights."""
    config = _config(bf16=True)
    config = dataclasses.replace(config, checkpoint=CheckpointConfig(save=str(tmp_path)))
    straight, layout, straight_losses = _stage(config, device)
    run_segment(straight, 0, 4, _on(device, gpt_feed(config, layout)))

    first, layout, first_losses = _stage(config, device)
    run_segment(first, 0, 2, _on(device, gpt_feed(config, layout)))
    first.iteration, first.consumed_samples = 2, 2 * config.training.global_batch_size
    save_checkpoint(first)
    resumed, layout, resumed_losses = _stage(config, device)
    load_checkpoint(resumed, str(tmp_path))
    assert resumed.iteration == 2 and resumed.versions.master[0].device.type == device.type
    run_segment(resumed, 2, 2, _on(device, gpt_feed(config, layout)))
    assert first_losses + resumed_losses == pytest.approx(straight_losses, rel=1e-5)
    for a, b in zip(straight.versions.master, resumed.versions.master):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
