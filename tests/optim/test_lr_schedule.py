"""The learning-rate schedule against Megatron-LM's definition, written out independently here:
Megatron counts warm-up and decay in samples (iterations x global batch), so a warm-up given as a
fraction of the decay, or in samples, need not end on a whole iteration."""
import math

import pytest

from megatron_2bw.config import OptimizerConfig, TrainingConfig
from megatron_2bw.optim.lr_schedule import learning_rate

GLOBAL_BATCH = 16


def megatron_lr(samples: float, lr: float, min_lr: float, warmup_samples: float,
                decay_samples: float, style: str) -> float:
    if warmup_samples > 0 and samples <= warmup_samples:
        return lr * samples / warmup_samples
    if samples > decay_samples:
        return min_lr
    ratio = (samples - warmup_samples) / (decay_samples - warmup_samples)
    coefficient = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coefficient * (lr - min_lr)


def iterations(train_iters: int) -> TrainingConfig:
    return TrainingConfig(train_iters=train_iters, global_batch_size=GLOBAL_BATCH)


@pytest.mark.parametrize("style", ["linear", "cosine"])
@pytest.mark.parametrize("fraction,decay_iters,train_iters", [
    (0.01, 250, 300),   # 2.5 warm-up iterations: ends between iterations 2 and 3
    (0.1, None, 40),    # no --lr-decay-iters: a fraction of --train-iters
    (0.0, 50, 60),
])
def test_warmup_fraction_follows_megatron(style, fraction, decay_iters, train_iters):
    opt = OptimizerConfig(lr=3e-4, min_lr=3e-5, lr_warmup_fraction=fraction,
                          lr_decay_iters=decay_iters, lr_decay_style=style)
    decay_samples = (decay_iters or train_iters) * GLOBAL_BATCH
    for iteration in range(train_iters):
        samples = (iteration + 1) * GLOBAL_BATCH  # the step that finishes `iteration`
        expected = megatron_lr(samples, 3e-4, 3e-5, fraction * decay_samples, decay_samples,
                               style)
        assert learning_rate(iteration, opt, iterations(train_iters)) == \
            pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("style", ["linear", "cosine"])
@pytest.mark.parametrize("warmup_samples,decay_samples,fraction", [
    (40, 500, None),    # 2.5 iterations of warm-up; decay ends between iterations 31 and 32
    (0, None, None),    # decay over --train-samples, which the iterations do not fill evenly
    (0, 300, 0.05),     # the fraction of the decay, in samples
])
def test_sample_based_schedule_follows_megatron(style, warmup_samples, decay_samples, fraction):
    train = TrainingConfig(train_iters=37, train_samples=600, global_batch_size=GLOBAL_BATCH)
    opt = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_samples=warmup_samples,
                          lr_decay_samples=decay_samples, lr_warmup_fraction=fraction,
                          lr_decay_style=style)
    decay = decay_samples or 600
    warmup = fraction * decay if fraction is not None else warmup_samples
    for iteration in range(train.train_iters):
        expected = megatron_lr((iteration + 1) * GLOBAL_BATCH, 1e-3, 1e-4, warmup, decay, style)
        assert learning_rate(iteration, opt, train) == pytest.approx(expected, rel=1e-12)


def test_fractional_warmup_reaches_the_peak_between_iterations():
    opt = OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_fraction=0.01, lr_decay_iters=250)
    assert learning_rate(0, opt, iterations(250)) == pytest.approx(0.4)
    assert learning_rate(1, opt, iterations(250)) == pytest.approx(0.8)
    assert learning_rate(2, opt, iterations(250)) == pytest.approx(1.0 - 0.5 / 247.5)


def test_warmup_iters_without_a_fraction():
    opt = OptimizerConfig(lr=1.0, lr_warmup_iters=4, lr_decay_style="constant")
    assert [learning_rate(i, opt, iterations(10)) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_a_decay_shorter_than_an_iteration_after_warmup():
    """40 samples of 16 per iteration: the decay ends at 2.5 iterations, a 0.7 warm-up at 1.75,
    so iteration 2 sits 0.25 into a 0.75-iteration decay."""
    train = TrainingConfig(train_iters=2, train_samples=40, global_batch_size=GLOBAL_BATCH)
    opt = OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_fraction=0.7)
    assert learning_rate(1, opt, train) == pytest.approx(
        megatron_lr(32, 1.0, 0.0, 0.7 * 40, 40, "linear"))
    assert learning_rate(1, opt, train) == pytest.approx(1.0 - 0.25 / 0.75)
