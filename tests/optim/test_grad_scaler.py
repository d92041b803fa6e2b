"""Loss scalers (Megatron semantics), and the skipped step they cause in a one-process fp16
stage."""
import pytest
import torch

from megatron_2bw.config import PrecisionConfig
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.optim.grad_scaler import DynamicLossScaler, NoLossScaler, build_loss_scaler
from megatron_2bw.training.segments import run_segment
from megatron_2bw.training.stage import build_stage
from tests.pipeline.harness import gpt_feed
from tests.pipeline.precision_harness import precise_config


def test_overflows_back_off_after_hysteresis_and_never_below_the_minimum():
    scaler = DynamicLossScaler(initial_scale=64.0, min_scale=16.0, window=100, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 64.0  # the first overflow only uses up hysteresis
    scaler.update(True)
    assert scaler.scale == 32.0
    scaler.update(True)  # hysteresis stays used up: every further overflow backs off
    assert scaler.scale == 16.0
    scaler.update(True)
    assert scaler.scale == 16.0  # floor: --min-loss-scale


def test_scale_grows_after_a_window_of_clean_steps_and_an_overflow_restarts_the_count():
    scaler = DynamicLossScaler(initial_scale=8.0, min_scale=1.0, window=3, hysteresis=2)
    scaler.update(False)
    scaler.update(False)
    scaler.update(True)  # restarts the window (and uses up one of the hysteresis)
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    assert scaler.scale == 16.0
    assert scaler.overflows_left == 2  # growth restores the hysteresis
    restored = DynamicLossScaler(1.0, 1.0, 3, 2)
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.clean_steps, restored.overflows_left) == (16.0, 0, 2)


def test_build_loss_scaler_follows_the_flags():
    assert isinstance(build_loss_scaler(PrecisionConfig(fp16=True)), DynamicLossScaler)
    assert build_loss_scaler(PrecisionConfig(fp16=True)).scale == 2.0 ** 32
    static = build_loss_scaler(PrecisionConfig(fp16=True, loss_scale=128.0))
    assert not static.dynamic and static.scale == 128.0
    static.update(True)
    assert static.scale == 128.0
    for precision in (PrecisionConfig(bf16=True), PrecisionConfig()):
        scaler = build_loss_scaler(precision)
        assert type(scaler) is NoLossScaler and scaler.scale == 1.0
    with pytest.raises(ValueError, match="--hysteresis"):
        build_loss_scaler(PrecisionConfig(fp16=True, hysteresis=0))


def _overflowing_at_batch_1(config):
    """A one-process fp16 stage whose batch 1 overflows; (stage, its step results, its feed)."""
    layout = ParallelLayout(1, 1, 1, 0)
    results = []
    stage = build_stage(config, layout, torch.device("cpu"), None, on_step=results.append)
    stage.updater.overflow_injection = lambda batch: batch == 1
    return stage, results, gpt_feed(config, layout)


def test_an_overflow_skips_the_step_keeps_the_version_and_backs_off():
    config = precise_config("fp16", schedule="flush", optimizer="adam", lr=0.01, layers=2)
    config.precision.hysteresis = 1
    stage, results, feed = _overflowing_at_batch_1(config)
    run_segment(stage, 0, 1, feed)
    before = [m.detach().clone() for m in stage.versions.master]
    step_count = [s["step"].item() for s in stage.optimizer.state.values()]
    run_segment(stage, 1, 1, feed)
    assert [r.skipped for r in results] == [False, True]
    assert all(torch.equal(a, m) for a, m in zip(before, stage.versions.master))
    assert [s["step"].item() for s in stage.optimizer.state.values()] == step_count  # Adam too
    assert stage.scaler.scale == 2.0 ** 11  # backed off once (hysteresis 1)
    v = stage.versions
    assert sorted(v.versions) == [2] and v.versions[2][0].dtype == torch.float16
    for leaf, m in zip(v.versions[2], v.master):  # version 2 still holds the master weights
        assert torch.equal(leaf, m.half())
    run_segment(stage, 2, 1, feed)
    assert not results[-1].skipped and results[-1].loss_scale == 2.0 ** 11
    assert all(torch.isfinite(m).all() for m in v.master)


def test_the_learning_rate_schedule_advances_on_applied_steps_only(tmp_path):
    """Megatron-LM steps its scheduler only after a successful update: the step after a skipped
    one takes the rate the skipped one had, and a resumed run keeps counting from there."""
    from megatron_2bw.checkpoint import load_checkpoint, save_checkpoint
    from megatron_2bw.optim.lr_schedule import learning_rate
    config = precise_config("fp16", schedule="flush", optimizer="adam", lr=0.01, layers=2)
    config.optimizer.lr_warmup_iters, config.training.train_iters = 10, 20  # a rising rate
    config.checkpoint.save = str(tmp_path)
    stage, results, feed = _overflowing_at_batch_1(config)
    run_segment(stage, 0, 3, feed)
    rate = [learning_rate(k, config.optimizer, config.training) for k in range(3)]
    assert [r.skipped for r in results] == [False, True, False]
    assert [r.learning_rate for r in results] == [rate[0], rate[1], rate[1]]
    stage.iteration = 3
    save_checkpoint(stage)
    resumed, resumed_results, resumed_feed = _overflowing_at_batch_1(config)
    load_checkpoint(resumed, str(tmp_path))
    assert resumed.applied_steps.skipped == 1
    run_segment(resumed, 3, 1, resumed_feed)
    results += resumed_results
    assert results[-1].learning_rate == rate[2]  # batch 3: the third applied step
