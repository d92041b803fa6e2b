"""What a stage does at a batch boundary: `reduce` after its last backward of a batch, `step` when the
schedule says the next version is due.

reduce(b): average the flat gradient buffer over the stage's data-parallel replicas (bucketed), move it
  into the fp32 master gradients (the buffer is free again for batch b+1), start the all-reduce of the
  tied word-embedding gradient over the first+last stage, and start one all-reduce over the whole
  model-parallel group of [sum of squared gradients, found-inf]. Nothing here waits on another stage.
step(b): wait for those two, then decide for every stage alike: skip (fp16 overflow: no new version,
  loss scale backs off) or unscale + clip + optimizer step, and create weight version b+1.
Under 2BW the schedule puts step(b) just before version b+1 is first needed, so cross-stage waiting
costs no bubble; under Flush/GPipe it follows reduce(b) directly, as in a flushed pipeline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.distributed.comm import all_reduce, group_rank, group_size
from megatron_2bw.pipeline.weights import WeightVersions


@dataclass
class StepResult:
    batch: int
    skipped: bool
    grad_norm: float
    learning_rate: float
    loss_scale: float
    metrics: dict = field(default_factory=dict)  # last stage: batch-mean losses


@dataclass
class _Pending:
    stats: torch.Tensor
    works: list
    tied: tuple | None  # (flat tied-embedding gradient, its all-reduce) still in flight
    loss_scale: float
    metrics: tuple  # (names, values)


class GradientUpdater:
    def __init__(self, versions: WeightVersions, optimizer, loss_scaler, lr_at, opt: OptimizerConfig,
                 data_group, embedding_group, model_group, tensor_group, bucket_elements: int,
                 timeout_minutes: float, timers=None):
        self.versions, self.optimizer, self.scaler = versions, optimizer, loss_scaler
        self.lr_at, self.clip_grad = lr_at, opt.clip_grad
        self.data_group, self.embedding_group = data_group, embedding_group
        self.model_group = model_group
        self.bucket_elements = bucket_elements
        self.timeout = timedelta(minutes=timeout_minutes)
        self.timers = timers
        tp_rank = group_rank(tensor_group)
        # each parameter counted once in the global norm: replicated ones on tp rank 0 only, the
        # last stage's copy of the tied embeddings not at all
        self.norm_mask = [not (s.tied_copy or (s.replicated and tp_rank != 0)) for s in versions.specs]
        self.tied = [i for i, s in enumerate(versions.specs) if s.tied]
        if not versions.alias:
            for m in versions.master:
                m.grad = torch.zeros_like(m)
        self.pending: dict[int, _Pending] = {}
        self.batch_scales: dict[int, float] = {}
        self.loss_sums: dict[int, dict[str, float]] = {}
        self.overflow_injection = None  # tests: callable(batch) -> bool puts an inf in the gradient

    # -- loss scaling --------------------------------------------------------------------------
    def loss_scale_for(self, batch: int) -> float:
        """The scale of a batch is fixed at its first backward (same value on every stage)."""
        return self.batch_scales.setdefault(batch, self.scaler.scale)

    def record_metrics(self, batch: int, metrics: dict) -> None:
        sums = self.loss_sums.setdefault(batch, {})
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)

    # -- batch boundary ------------------------------------------------------------------------
    def _time(self, name):
        return self.timers(name) if self.timers is not None else None

    def _wait(self, work):
        if work is not None:
            work.wait(self.timeout)

    @torch.no_grad()
    def reduce(self, batch: int, microbatches: int) -> None:
        timer = self._time("allreduce")
        timer and timer.start()
        buffer = self.versions.main_grad_buffer
        if self.overflow_injection is not None and self.overflow_injection(batch):
            buffer[0] = float("inf")
        if group_size(self.data_group) > 1:
            works = [all_reduce(bucket, self.data_group, op=dist.ReduceOp.AVG, async_op=True)
                     for bucket in buffer.split(self.bucket_elements)]
            for work in works:
                self._wait(work)
        master = self.versions.master
        if not self.versions.alias:
            for m, g in zip(master, self.versions.main_grads):
                m.grad.copy_(g)
            buffer.zero_()
        tied = None
        if self.tied and group_size(self.embedding_group) > 1:
            flat = torch.cat([master[i].grad.view(-1) for i in self.tied])
            tied = (flat, all_reduce(flat, self.embedding_group, async_op=True))
            if not self.versions.specs[self.tied[0]].tied_copy:
                # the first stage counts the tied weights in the norm: it needs the sum now (the
                # last stage finished this batch earlier, so this wait is short)
                self._finish_tied(tied)
                tied = None
        squares = [m.grad.float().pow(2).sum() for m, counted in zip(master, self.norm_mask) if counted]
        stats = torch.stack([torch.stack(squares).sum() if squares else torch.zeros(())])
        work = all_reduce(stats, self.model_group, async_op=True)
        sums = self.loss_sums.pop(batch, {})
        metrics = (list(sums), torch.tensor([v / microbatches for v in sums.values()]))
        metrics_work = None  # the batch mean over data-parallel replicas, as Megatron reports it
        if sums and group_size(self.data_group) > 1:
            metrics_work = all_reduce(metrics[1], self.data_group, op=dist.ReduceOp.AVG,
                                      async_op=True)
        self.pending[batch] = _Pending(stats, [work, metrics_work], tied, self.loss_scale_for(batch),
                                       metrics)
        timer and timer.stop()

    @torch.no_grad()
    def step(self, batch: int) -> StepResult:
        timer = self._time("optimizer")
        timer and timer.start()
        pending = self.pending.pop(batch)
        for work in pending.works:
            self._wait(work)
        names, values = pending.metrics
        metrics = dict(zip(names, values.tolist()))
        if pending.tied is not None:
            self._finish_tied(pending.tied)
        self.batch_scales.pop(batch, None)
        squared = float(pending.stats[0])
        scale = pending.loss_scale
        lr = self.lr_at(batch)
        found_inf = not math.isfinite(squared)
        if found_inf:
            self.scaler.update(True)
            self.versions.create(batch + 1, skipped=True)
            self._clear_grads()
            timer and timer.stop()
            return StepResult(batch, True, float("nan"), lr, scale, metrics)
        grad_norm = math.sqrt(squared) / scale
        coefficient = 1.0 / scale
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            coefficient *= self.clip_grad / (grad_norm + 1e-6)
        if coefficient != 1.0:
            for m in self.versions.master:
                m.grad.mul_(coefficient)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.scaler.update(False)
        self.versions.create(batch + 1)
        self._clear_grads()
        timer and timer.stop()
        return StepResult(batch, False, grad_norm, lr, scale, metrics)

    def _finish_tied(self, tied) -> None:
        flat, work = tied
        self._wait(work)
        offset = 0
        for i in self.tied:
            grad = self.versions.master[i].grad
            grad.view(-1).copy_(flat[offset:offset + grad.numel()])
            offset += grad.numel()

    def _clear_grads(self) -> None:
        if self.versions.alias:  # master .grad is the accumulation buffer itself
            self.versions.main_grad_buffer.zero_()
