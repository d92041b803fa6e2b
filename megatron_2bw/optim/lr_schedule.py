"""Learning rate of the step that finishes iteration `iteration` (0-based): linear warm-up, then
constant, linear or cosine decay to --min-lr at the end of the decay.

Lengths come in iterations (--lr-warmup-iters, --lr-decay-iters, default --train-iters) or, with
--train-samples, in samples (--lr-warmup-samples, --lr-decay-samples, default --train-samples),
or the warm-up as a fraction of the decay (--lr-warmup-fraction). Megatron-LM counts its schedule
in samples, so a warm-up or decay need not end on a whole iteration; neither does this one."""
from __future__ import annotations

import math

from megatron_2bw.config import OptimizerConfig, TrainingConfig


def schedule_iterations(opt: OptimizerConfig, train: TrainingConfig) -> tuple[float, float]:
    """(warm-up, decay end) in iterations, possibly fractional."""
    if train.train_samples is not None:
        samples_per_iteration = train.global_batch_size
        decay = (opt.lr_decay_samples or train.train_samples) / samples_per_iteration
        warmup = opt.lr_warmup_samples / samples_per_iteration
    else:
        decay = opt.lr_decay_iters or train.train_iters
        warmup = opt.lr_warmup_iters
    if opt.lr_warmup_fraction is not None:
        warmup = opt.lr_warmup_fraction * decay
    return warmup, decay


def learning_rate(iteration: int, opt: OptimizerConfig, train: TrainingConfig) -> float:
    step = iteration + 1
    warmup, decay = schedule_iterations(opt, train)
    if warmup > 0 and step <= warmup:
        return opt.lr * step / warmup
    if opt.lr_decay_style == "constant":
        return opt.lr
    if step >= decay:
        return opt.min_lr
    ratio = (step - warmup) / (decay - warmup)  # warmup < step < decay here
    if opt.lr_decay_style == "linear":
        coefficient = 1.0 - ratio
    else:
        coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return opt.min_lr + coefficient * (opt.lr - opt.min_lr)
