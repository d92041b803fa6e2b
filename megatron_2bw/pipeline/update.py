"""What a stage does at a batch boundary: `reduce` after its last backward of a batch, `step` when the
schedule says the next version is due.

reduce(b): start averaging the flat gradient buffer over the stage's data-parallel replicas in the
  background, in the buffer's dtype: an all-reduce in buckets, or with the distributed optimizer
  a reduce-scatter per region (bucket) of the flat layout, so each rank keeps the average of its
  own shard; with --overlap-grad-reduce most of them already started during the batch's last
  backward as their gradients became ready (pipeline/overlap.py).
finish_data_reductions(): called before each backward, the first write to the buffer after
  reduce(b), and by step. Once the average is in, it sums over the tensor-parallel group the
  gradients each rank computed in part (sequence-parallel norms, qk-layernorm), moves the buffer
  into the fp32 master gradients where they are separate (the buffer is free again for batch
  b+1), then starts the all-reduce of the tied word-embedding gradient over the first+last
  stage and one all-reduce over the whole
  model-parallel group of the sum of squared gradients (non-finite if any rank overflowed; with
  the distributed optimizer over every replica too, adding up the shards' sums). So
  under 2BW the data-parallel transfer overlaps the forward that follows reduce(b), and the point
  where it must be in is fixed by the schedule, the same on every rank. Nothing here waits on
  another stage: the first stage, which counts the tied embeddings in the norm and so needs their
  summed gradient, starts its part of the norm at step(b) instead.
step(b): wait for those, then decide for every stage alike: skip (fp16 overflow anywhere: no new
  version, the loss scale backs off) or unscale + clip + optimizer step, and create weight version b+1.
  Outside fp16 a non-finite norm stops the job (--check-for-nan-in-loss-and-grad; every rank sees
  the same norm, so every rank raises) or, with the check off, skips the step as an overflow.
`model_group` is the group that decides a step together: the whole model, or under plain PipeDream
(schedules.VersionRule.global_step_decisions) the stage's tensor-parallel group: there stage s > 0
needs version b+1 before the first stage has computed its gradient of batch b, so a global norm
would stall the pipeline; each stage clips by its own gradients' norm (as PipeDream's runtime did)
and reports that norm, and dynamic fp16 loss scaling is refused (the stages' scales would differ).
Under 2BW (and PipeDream's vertical sync) the schedule puts step(b) just before version b+1 is first
needed, so cross-stage waiting costs no bubble: a stage r > 0 starts its norm before its first backward of batch b+1, which the
first stage's backward of the same microbatch, and so its step(b), has to wait for. Under
Flush/GPipe step(b) follows reduce(b) directly, as in a flushed pipeline.

The loss scale of a batch is the scale right after the step that made the version the batch uses:
every stage derives it from the batch index alone, whenever it asks (the last stage at its first
backward, the others at reduce), so all stages unscale a batch by the factor it was scaled with.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.distributed.comm import all_reduce, group_rank, group_size
from megatron_2bw.optim.distributed import DistributedOptimizer
from megatron_2bw.optim.muon import Muon, WholeMatrices
from megatron_2bw.optim.optimizer import initialize_state
from megatron_2bw.pipeline.overlap import (BackwardBucketReducer, bucket_bounds,
                                           start_bucket_reduction)
from megatron_2bw.pipeline.weights import WeightVersions
from megatron_2bw.tensor_parallel.layers import sum_tensor_partial_grads


@dataclass
class StepResult:
    batch: int
    skipped: bool
    grad_norm: float
    learning_rate: float  # the main groups' (--decoupled-lr's groups may have another)
    loss_scale: float
    metrics: dict = field(default_factory=dict)  # last stage: batch-mean losses
    # time.perf_counter() when this rank began reducing the batch: right after its last backward
    # of the batch (on 2BW's last stage, after the previous batch's step, which is due there).
    # Batches end one batch of work apart in every schedule; 2BW's deferred steps bunch up at a drain
    ended_at: float = 0.0
    params_norm: float | None = None  # --log-params-norm: of the master weights after the step
    num_zeros_in_grad: int | None = None  # --log-num-zeros-in-grad; None for a skipped step


@dataclass
class _Pending:
    data_works: list  # the data-parallel average of the gradient buffer, still in flight
    works: list
    loss_scale: float
    metrics: tuple  # (names, the metrics' sums and last the denominator, as one tensor)
    stats: torch.Tensor | None = None  # None: not started; the first stage starts it at step
    norm_work: object | None = None
    tied: object | None = None  # the tied-embedding gradient's all-reduce, still in flight
    ended_at: float = 0.0  # StepResult.ended_at


class GradientUpdater:
    """`schedule(param_groups, batch)` sets every group's learning rate and weight decay for the
    step of `batch` and returns the main rate (lr_schedule.apply_schedule). `check_for_nan`: a
    non-finite gradient norm outside fp16 raises instead of skipping the step (fp16 skips: an
    overflow is its loss scaler's to handle). `log_params_norm`, `log_num_zeros_in_grad`: each
    StepResult carries the norm of the weights, the zero entries of the gradients (a pass over
    them and one small all-reduce per step). `sharded_norm_group`: with the distributed
    optimizer, the group of every rank of `model_group`'s replicas (data x model ranks), over
    which the shards' sums of squares add up in one all-reduce in the background; without it
    they are summed over `data_group` first, waiting for that."""

    def __init__(self, versions: WeightVersions, optimizer, loss_scaler, schedule,
                 opt: OptimizerConfig, data_group, embedding_group, model_group, tensor_group,
                 bucket_elements: int, timers=None,
                 check_for_nan: bool = False, log_params_norm: bool = False,
                 log_num_zeros_in_grad: bool = False, per_token_loss: bool = False,
                 overlap_grad_reduce: bool = True, sharded_norm_group=None):
        self.versions, self.optimizer, self.scaler = versions, optimizer, loss_scaler
        self.schedule, self.clip_grad = schedule, opt.clip_grad
        self.stop_on_nonfinite_norm = check_for_nan and versions.working_dtype != torch.float16
        self.log_params_norm, self.log_num_zeros_in_grad = log_params_norm, log_num_zeros_in_grad
        self.per_token_loss = per_token_loss
        self.data_group, self.embedding_group = data_group, embedding_group
        self.model_group, self.tensor_group = model_group, tensor_group
        self.bucket_elements = bucket_elements
        self.sharded_norm_group = sharded_norm_group
        self.timers = timers
        tp_rank = group_rank(tensor_group)
        # each parameter counted once in the global norm (and the weights' statistics): replicated
        # ones on tp rank 0 only, the last stage's copy of the tied embeddings not at all
        self.norm_mask = [not (s.tied_copy or (s.replicated and tp_rank != 0)) for s in versions.specs]
        self.tied = any(s.tied for s in versions.specs)  # then region 0 of the flat buffers
        self.tied_copy = any(s.tied_copy for s in versions.specs)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.shard(versions)
        inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
        if isinstance(inner, Muon):  # orthogonalise whole matrices, not this rank's parts
            inner.whole_matrices = WholeMatrices(tensor_group, versions)
        initialize_state(optimizer)
        self.pending: dict[int, _Pending] = {}
        self.version_scales = {0: loss_scaler.scale}  # version -> scale of the batches using it
        self.loss_sums: dict[int, dict[str, float]] = {}
        self.loss_tokens: dict[int, torch.Tensor] = {}  # per_token_loss: batch -> its tokens
        self.overflow_injection = None  # tests: callable(batch) -> bool puts an inf in the gradient
        self.compensation = None  # --delay-compensation (pipeline/compensation.py), set after sharding
        self.pipemare = None  # PipeMare's T1/T2 (pipeline/pipemare.py)
        # the data-parallel average started bucket by bucket in the batch's last backward
        self.backward_reducer = None
        if overlap_grad_reduce and group_size(data_group) > 1:
            self.backward_reducer = BackwardBucketReducer(versions, data_group, bucket_elements)
        self._backwards: dict[int, int] = {}  # batch -> backwards run of it

    # -- loss scaling --------------------------------------------------------------------------
    def loss_scale_for(self, batch: int) -> float:
        """The scale the batch's loss is multiplied by (the same on every stage, see above)."""
        version = self.versions.version_for_batch(batch)
        if version not in self.version_scales:
            # versions restored from a checkpoint: until the next step the current scale is the
            # same on every stage, so fix it now for every live version
            for alive in [version, *self.versions.versions]:
                self.version_scales.setdefault(alive, self.scaler.scale)
        return self.version_scales[version]

    def loss_weight(self, tokens, microbatches: int):
        """What a microbatch's mean loss is multiplied by before backward (besides the loss
        scale): its tokens under per_token_loss (the batch's total divides at the step), else
        1/m, the mean over the batch's microbatches."""
        return tokens if self.per_token_loss else 1.0 / microbatches

    def record_tokens(self, batch: int, tokens: torch.Tensor) -> None:
        """per_token_loss: every stage counts the tokens its batch's losses cover (summed on the
        device: no wait for the microbatch's work)."""
        self.loss_tokens[batch] = self.loss_tokens.get(batch, 0) + tokens

    def record_metrics(self, batch: int, metrics: dict, tokens) -> None:
        """The last stage's microbatch means, weighted by their tokens under per_token_loss."""
        weight = tokens if self.per_token_loss else 1.0
        sums = self.loss_sums.setdefault(batch, {})
        for key, value in metrics.items():  # in float64, on the device (no wait for the value)
            sums[key] = sums.get(key, 0.0) + torch.as_tensor(value, dtype=torch.float64) * weight

    # -- batch boundary ------------------------------------------------------------------------
    def _time(self, name):
        return self.timers(name) if self.timers is not None else None

    def _wait(self, work):
        # no host timeout: under NCCL that would block the host until the work is done, where a
        # plain wait only orders the current stream after it; the process group's timeout still
        # ends a stalled reduction
        if work is not None:
            work.wait()

    def before_backward(self, batch: int, passes: int) -> None:
        """Called before each pass that accumulates weight gradients (a backward, or W of a split
        one), `passes` of them per batch: the batch's last arms the bucket-by-bucket average."""
        self._backwards[batch] = self._backwards.get(batch, 0) + 1
        if self._backwards[batch] == passes:
            del self._backwards[batch]
            if self.backward_reducer is not None and self.overflow_injection is None:
                self.backward_reducer.arm()

    @torch.no_grad()
    def reduce(self, batch: int, microbatches: int) -> None:
        ended_at = time.perf_counter()
        timer = self._time("allreduce")
        timer and timer.start()
        v = self.versions
        buffer = v.main_grad_buffer
        if self.overflow_injection is not None and self.overflow_injection(batch):
            buffer[0] = float("inf")
        data_works = []
        if self.backward_reducer is not None and self.backward_reducer.armed:
            data_works = self.backward_reducer.finish()  # started during the last backward
        elif group_size(self.data_group) > 1:
            data_works = [start_bucket_reduction(v, self.data_group, j, lo, hi)
                          for j, (lo, hi) in enumerate(bucket_bounds(v, self.bucket_elements))]
        sums = self.loss_sums.pop(batch, {})
        denominator = self.loss_tokens.pop(batch) if self.per_token_loss else microbatches
        # the metrics' sums and their denominator, summed over the data-parallel replicas: the
        # batch mean as Megatron reports it, and under per_token_loss the tokens the step divides by
        totals = torch.stack([_float64_on(v.device, x) for x in (*sums.values(), denominator)])
        metrics_work = None
        if (sums or self.per_token_loss) and group_size(self.data_group) > 1:
            metrics_work = all_reduce(totals, self.data_group, async_op=True)
        pending = _Pending(data_works, [metrics_work], self.loss_scale_for(batch),
                           (list(sums), totals), ended_at=ended_at)
        self.pending[batch] = pending
        if not data_works:
            self._averaged(pending)
        timer and timer.stop()

    @torch.no_grad()
    def finish_data_reductions(self) -> None:
        """Wait for the data-parallel average still in flight, if any, and go on from there."""
        for batch, pending in self.pending.items():  # insertion order: oldest batch first
            if not pending.data_works:
                continue
            timer = self._time("allreduce")
            timer and timer.start()
            try:
                for work in pending.data_works:
                    self._wait(work)
            except Exception as error:  # noqa: BLE001 - the caller names the stage and action
                raise RuntimeError(f"the data-parallel gradient reduction of batch {batch}, "
                                   f"started with its last backward, failed: {error}") from error
            pending.data_works = []
            self._averaged(pending)
            timer and timer.stop()

    def _averaged(self, pending: _Pending) -> None:
        """The batch's average is in the buffer: sum over the tensor-parallel group the
        gradients each rank computed in part (sequence-parallel norms, qk-layernorm), in the
        part this rank averaged (the sum commutes with the average, which can so start bucket
        by bucket in the backward), move it into the master gradients, then start the
        tied-embedding all-reduce and this stage's part of the norm."""
        v = self.versions
        sum_tensor_partial_grads(v.averaged_grads(), v.specs, self.tensor_group)
        v.take_gradients()
        if self.tied and group_size(self.embedding_group) > 1:
            pending.tied = all_reduce(v.master_grad_regions[0], self.embedding_group,
                                      async_op=True)
        if pending.tied is None or self.tied_copy:
            pending.stats, pending.norm_work = self._start_norm()
        # else (first stage): it counts the tied weights in the norm, so it needs their sum; it
        # starts its part of the norm at step(b), whose turn comes before every other stage's
        # step(b) in a 1F1B schedule, instead of blocking here on the embedding transfer

    def _counted(self) -> list[torch.nn.Parameter]:
        """The master weights this rank counts in global sums (norm_mask)."""
        return [m for m, counted in zip(self.versions.master, self.norm_mask) if counted]

    def _sum_of_squares(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        # per-tensor norms: no temporary of the tensors' size (pow(2) would allocate one)
        norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]
        return torch.stack(norms).square().sum() if norms else \
            torch.zeros((), device=self.versions.device)

    def _start_norm(self):
        """This rank's sum of squared master gradients, summed over the model-parallel group in
        the background (non-finite when any rank overflowed)."""
        stats = torch.stack([self._sum_of_squares([m.grad for m in self._counted()])])
        group = self.model_group
        if self.versions.sharded:  # the shards add up over the replicas too
            group = self.sharded_norm_group
            if group is None:  # the replicas are in step here: add up their shards first
                all_reduce(stats, self.data_group)
                group = self.model_group
        return stats, all_reduce(stats, group, async_op=True)

    def _zeros_in_grad(self) -> torch.Tensor:
        """This rank's zero entries of the master gradients it counts."""
        counted = self._counted()
        nonzero = sum((torch.count_nonzero(m.grad) for m in counted),
                      torch.zeros((), dtype=torch.int64, device=self.versions.device))
        return sum(m.numel() for m in counted) - nonzero

    def _weight_statistics(self, zeros: torch.Tensor | None) -> tuple[float | None, int | None]:
        """(params norm, zeros in the gradients) as asked for, over the whole model: summed over
        the model-parallel group (with the distributed optimizer, over the shards first) in one
        all-reduce. The norm is of the master weights now, after the step: under 2BW, of version
        b+1 that step(b) creates, not of version b-1 that batch b's gradients were computed on
        (Megatron too reports the norm after its step)."""
        if not (self.log_params_norm or self.log_num_zeros_in_grad):
            return None, None
        squares = self._sum_of_squares(self._counted()) if self.log_params_norm else 0.0
        # float64: a count above 2**24 stays exact
        stats = torch.zeros(2, dtype=torch.float64, device=self.versions.device)
        stats[0] = squares
        if zeros is not None:
            stats[1] = zeros
        if self.versions.sharded:
            all_reduce(stats, self.data_group)
        all_reduce(stats, self.model_group)
        params_norm = math.sqrt(float(stats[0])) if self.log_params_norm else None
        num_zeros = int(stats[1]) if zeros is not None else None
        return params_norm, num_zeros

    def _nonfinite_norm_error(self, batch: int, squared: float) -> FloatingPointError:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return FloatingPointError(
            f"rank {rank}: the gradient norm of iteration {batch + 1} is {math.sqrt(squared)}: a "
            f"NaN or infinity in the gradients of some stage (every rank sees this norm and "
            f"stops). --check-for-nan-in-loss-and-grad is on; --no-check-for-nan-in-loss-and-grad "
            f"would skip such steps instead")

    @torch.no_grad()
    def step(self, batch: int) -> StepResult:
        self.finish_data_reductions()
        timer = self._time("optimizer")
        timer and timer.start()
        pending = self.pending.pop(batch)
        for work in pending.works:
            self._wait(work)
        names, totals = pending.metrics
        *sums, denominator = totals.tolist()
        denominator = max(denominator, 1.0)  # a batch whose loss mask hides every token
        metrics = {name: value / denominator for name, value in zip(names, sums)}
        self._wait(pending.tied)
        stats, norm_work = pending.stats, pending.norm_work
        if stats is None:
            stats, norm_work = self._start_norm()
        self._wait(norm_work)
        squared = float(stats[0])
        # the buffer holds the replicas' average of per-token sums: one replica's mean tokens
        # turn it into the per-token mean over all of the batch's tokens
        tokens = denominator / group_size(self.data_group) if self.per_token_loss else 1.0
        scale = pending.loss_scale
        lr = self.schedule(self.optimizer.param_groups, batch)
        if not math.isfinite(squared):
            if self.stop_on_nonfinite_norm:
                raise self._nonfinite_norm_error(batch, squared)
            self.scaler.update(True)
            if self.compensation is not None:
                self.compensation.skipped_step()
            if self.pipemare is not None:
                self.pipemare.skipped_step()
            self._new_version(batch, skipped=True)
            params_norm, _ = self._weight_statistics(None)
            timer and timer.stop()
            return StepResult(batch, True, float("nan"), lr, scale, metrics, pending.ended_at,
                              params_norm)
        grad_norm = math.sqrt(squared) / (scale * tokens)
        coefficient = 1.0 / (scale * tokens)
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            coefficient *= self.clip_grad / (grad_norm + 1e-6)
        if coefficient != 1.0:
            for grad in self.versions.master_grad_regions:
                grad.mul_(coefficient)
        # Megatron counts the zeros of the unscaled, clipped gradients the optimizer steps with
        zeros = self._zeros_in_grad() if self.log_num_zeros_in_grad else None
        self.versions.prepare_step()
        if self.compensation is not None:
            self.compensation.before_step()
        if self.pipemare is not None:
            self.pipemare.before_step(batch, self.optimizer.param_groups)
        self.optimizer.step()
        if self.compensation is not None:
            self.compensation.after_step()
        self.scaler.update(False)
        self._new_version(batch, skipped=False)
        if self.pipemare is not None:  # the new version is in the working copy now
            self.pipemare.after_step()
        params_norm, num_zeros = self._weight_statistics(zeros)
        timer and timer.stop()
        return StepResult(batch, False, grad_norm, lr, scale, metrics, pending.ended_at,
                          params_norm, num_zeros)

    def _new_version(self, batch: int, skipped: bool) -> None:
        v = self.versions
        v.create(batch + 1, skipped)
        self.version_scales[batch + 1] = self.scaler.scale
        oldest_needed = v.version_for_batch(batch + 1)  # no batch before b+1 asks any more
        self.version_scales = {k: s for k, s in self.version_scales.items() if k >= oldest_needed}
        if v.shared_grads:  # the master gradients are the accumulation buffer itself
            v.main_grad_buffer.zero_()


def _float64_on(device: torch.device, value) -> torch.Tensor:
    """A float64 scalar on the device: a tensor converted there, a number filled in by a kernel
    (torch.tensor(number, device=cuda) would be a blocking host-to-device copy)."""
    if torch.is_tensor(value):
        return value.to(device=device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)
