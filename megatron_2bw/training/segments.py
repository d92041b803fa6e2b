"""Training runs in segments: batches between two drains (evaluation, checkpoints, exit checks,
repartitioning, changes of the batch size), each run as one schedule (2BW: one never-drained 1F1B
sequence). Drained points are where collectives over all ranks are safe."""
from __future__ import annotations

import torch

from megatron_2bw.batch_schedule import batch_schedule
from megatron_2bw.config import Config
from megatron_2bw.pipeline.schedules import stage_actions
from megatron_2bw.training.stage import Stage


class MicrobatchFeed:
    """Hands the executor microbatch k (forwards come in increasing k on every stage)."""

    def __init__(self, iterator, device: torch.device, first_microbatch: int):
        self.iterator, self.device, self.expected = iterator, device, first_microbatch

    def __call__(self, k: int) -> dict:
        if k != self.expected:
            raise RuntimeError(f"microbatch {k} requested, {self.expected} expected")
        self.expected += 1
        batch = next(self.iterator)
        return {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}


def microbatches_of(stage: Stage, batch: int) -> int:
    """m of `batch`: its global batch (batch_schedule.py) over micro x d."""
    train = stage.config.training
    return batch_schedule(train).global_batch(batch) // (train.micro_batch_size *
                                                         stage.layout.data_replicas)


def run_segment(stage: Stage, first_batch: int, batches: int, feed: MicrobatchFeed) -> None:
    """Batches first_batch.. of one size (segment_ends cuts at every change of the batch size)."""
    par = stage.config.parallel
    m = stage.executor.m = microbatches_of(stage, first_batch)
    actions = stage_actions(par.pipeline_schedule, par.pipeline_parallel, m, batches,
                            stage.layout.stage, first_batch, par.model_chunks)
    stage.executor.run(actions, feed)


def segment_ends(config: Config, start: int) -> list[int]:
    """Iterations after which the pipeline drains (evaluation, checkpoint, exit checks,
    repartitioning, the bounds of --profile's window, changes of the batch size, the end)."""
    train, ckpt, logs = config.training, config.checkpoint, config.logging
    if train.skip_train:
        return []
    intervals = [train.eval_interval] if train.eval_iters else []  # --eval-iters 0: no validation
    if ckpt.save and ckpt.save_interval:
        intervals.append(ckpt.save_interval)
    if train.exit_interval:
        intervals.append(train.exit_interval)
    if config.parallel.repartition_interval:  # layers move between stages only when drained
        intervals.append(config.parallel.repartition_interval)
    if train.exit_signal_handler or train.exit_duration_in_mins:
        intervals.append(train.log_interval)  # bounded reaction time to SIGTERM / the time limit
    ends = {train.train_iters, *batch_schedule(train).changes()}
    for interval in intervals:
        ends.update(range(interval, train.train_iters, interval))
    if logs.profile:  # the trace then holds whole iterations (IterationProfiler)
        ends.update(b for b in (logs.profile_step_start, logs.profile_step_end)
                    if b < train.train_iters)
    return sorted(e for e in ends if start < e <= train.train_iters)
