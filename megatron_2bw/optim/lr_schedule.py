"""Learning rate of the step that finishes iteration `iteration` (0-based): linear warm-up, then
constant, linear or cosine decay to --min-lr at --lr-decay-iters."""
from __future__ import annotations

import math

from megatron_2bw.config import OptimizerConfig


def warmup_iters(opt: OptimizerConfig, train_iters: int) -> float:
    """--lr-warmup-iters, or --lr-warmup-fraction of the decay iterations; like Megatron-LM's, a
    fraction's warm-up need not end on a whole iteration."""
    if opt.lr_warmup_fraction is not None:
        return opt.lr_warmup_fraction * (opt.lr_decay_iters or train_iters)
    return opt.lr_warmup_iters


def learning_rate(iteration: int, opt: OptimizerConfig, train_iters: int) -> float:
    step = iteration + 1
    warmup = warmup_iters(opt, train_iters)
    if warmup > 0 and step <= warmup:
        return opt.lr * step / warmup
    if opt.lr_decay_style == "constant":
        return opt.lr
    decay_iters = opt.lr_decay_iters or train_iters
    if step >= decay_iters:
        return opt.min_lr
    ratio = (step - warmup) / max(decay_iters - warmup, 1)
    if opt.lr_decay_style == "linear":
        coefficient = 1.0 - ratio
    else:
        coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return opt.min_lr + coefficient * (opt.lr - opt.min_lr)
