"""Learning rate of the step that finishes iteration `iteration` (0-based): linear warm-up, then
constant, linear or cosine decay to --min-lr at --lr-decay-iters."""
from __future__ import annotations

import math

from megatron_2bw.config import OptimizerConfig


def learning_rate(iteration: int, opt: OptimizerConfig, train_iters: int) -> float:
    step = iteration + 1
    if opt.lr_warmup_iters > 0 and step <= opt.lr_warmup_iters:
        return opt.lr * step / opt.lr_warmup_iters
    if opt.lr_decay_style == "constant":
        return opt.lr
    decay_iters = opt.lr_decay_iters or train_iters
    if step >= decay_iters:
        return opt.min_lr
    ratio = (step - opt.lr_warmup_iters) / max(decay_iters - opt.lr_warmup_iters, 1)
    if opt.lr_decay_style == "linear":
        coefficient = 1.0 - ratio
    else:
        coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return opt.min_lr + coefficient * (opt.lr - opt.min_lr)
