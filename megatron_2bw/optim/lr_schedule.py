"""Megatron-LM's OptimizerParamScheduler as functions of the iteration: the learning rate and the
weight decay of the step that finishes iteration `iteration` (0-based). Nothing is stateful, so a
resumed run continues both schedules with nothing saved.

Learning rate: linear warm-up from --lr-warmup-init to the peak, then constant, linear or cosine
decay to the final rate at the end of the decay. The main parameter groups peak at --lr and end at
--min-lr; with --decoupled-lr the input embeddings and the output layer (optim/optimizer.py
`is_embedding_or_output`) follow the same shape from --decoupled-lr to --decoupled-min-lr
(default --min-lr).

Lengths come in iterations (--lr-warmup-iters, --lr-decay-iters, default --train-iters) or, with
--train-samples, in samples (--lr-warmup-samples, --lr-decay-samples, default --train-samples),
or the warm-up as a fraction of the decay (--lr-warmup-fraction). Megatron-LM counts its schedule
in samples, so a warm-up or decay need not end on a whole iteration; neither does this one. Under
--rampup-batch-size an iteration advances the schedules by its own batch (batch_schedule.py).

Weight decay: --weight-decay throughout, or from --start-weight-decay to --end-weight-decay over the
whole training (--weight-decay-incr-style linear or cosine), on the decayed groups only."""
from __future__ import annotations

import math

from megatron_2bw.batch_schedule import batch_schedule
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


def training_iterations(train: TrainingConfig) -> float:
    """The whole training in iterations, possibly fractional (Megatron's weight-decay increment
    spans --train-iters, or --train-samples)."""
    if train.train_samples is not None:
        return train.train_samples / train.global_batch_size
    return train.train_iters


def schedule_position(iteration: int, train: TrainingConfig) -> float:
    """Where the step that finishes `iteration` stands, in global batches of samples consumed:
    iteration + 1, or under a batch-size ramp fewer (its early batches are smaller)."""
    if not train.rampup_batch_size:
        return iteration + 1
    return batch_schedule(train).consumed(iteration + 1) / train.global_batch_size


def learning_rate(iteration: int, opt: OptimizerConfig, train: TrainingConfig,
                  decoupled: bool = False) -> float:
    """The rate of the main groups, or with `decoupled` of the embedding and output groups."""
    if decoupled:
        peak = opt.decoupled_lr
        final = opt.decoupled_min_lr if opt.decoupled_min_lr is not None else opt.min_lr
    else:
        peak, final = opt.lr, opt.min_lr
    step = schedule_position(iteration, train)
    warmup, decay = schedule_iterations(opt, train)
    if warmup > 0 and step <= warmup:
        return opt.lr_warmup_init + (peak - opt.lr_warmup_init) * step / warmup
    if opt.lr_decay_style == "constant":
        return peak
    if step >= decay:
        return final
    ratio = (step - warmup) / (decay - warmup)  # warmup < step < decay here
    if opt.lr_decay_style == "linear":
        coefficient = 1.0 - ratio
    else:
        coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return final + coefficient * (peak - final)


def weight_decay(iteration: int, opt: OptimizerConfig, train: TrainingConfig) -> float:
    """The decay of the decayed groups (the others have none)."""
    start = opt.start_weight_decay if opt.start_weight_decay is not None else opt.weight_decay
    end = opt.end_weight_decay if opt.end_weight_decay is not None else opt.weight_decay
    ratio = min(schedule_position(iteration, train) / training_iterations(train), 1.0)
    if opt.weight_decay_incr_style == "linear":
        coefficient = ratio
    elif opt.weight_decay_incr_style == "cosine":
        coefficient = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
    else:  # constant: config_checks.py refuses --start/--end-weight-decay, so start == end
        coefficient = 1.0
    return start + coefficient * (end - start)


def apply_schedule(param_groups: list[dict], iteration: int, opt: OptimizerConfig,
                   train: TrainingConfig) -> float:
    """Set every group's rate and decay for the step that finishes `iteration`, by the schedule the
    group follows (optim/optimizer.py `param_groups`); returns the main rate (the one logged)."""
    main_rate = learning_rate(iteration, opt, train)
    decoupled_rate = learning_rate(iteration, opt, train, decoupled=True) \
        if opt.decoupled_lr is not None else main_rate
    decay = weight_decay(iteration, opt, train)
    for group in param_groups:
        group["lr"] = decoupled_rate if group["is_decoupled_lr"] else main_rate
        group["weight_decay"] = decay * group["wd_mult"]
    return main_rate
