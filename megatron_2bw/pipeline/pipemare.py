"""PipeMare (Yang et al., MLSys'21): asynchronous 1F1B with one weight version per stage.

The schedule (--pipeline-schedule pipemare) is 2BW's never-drained 1F1B order over every
microbatch of a segment, but a stage holds ONE weight version and steps as soon as a batch's
gradients are reduced (reduce, step, right after the batch's last backward on that stage). With
w_s = p - 1 - s warm-up forwards on stage s, microbatch k (batch b = k // m) therefore reads

    forward:  version max(floor((k - w_s) / m), f)     (f: the segment's first batch)
    backward: version b, the newest weights W(b)       (or T2's prediction, below)

because the forward of k follows the backwards of microbatches 0 .. k - w_s - 1 and the backward
of k follows those of 0 .. k - 1. Its delay, d_k = b - forward version, is w_s updates at m = 1
(the paper's setting); with m > 1 it is ceil((w_s - j) / m) for the j-th microbatch of a batch
(w_s / m on average). tau_s = ceil(w_s / m), the largest delay of the stage, drives T1 and T2.
A segment boundary (evaluation, checkpoint) drains the pipeline, so the first forwards after it
read the newest weights: the rule depends on where the segments end.

The backward differentiates with the forward's activations and the backward-time weights: every
weight autograd saved at the forward (a view of the stage's working copy) is read at backward
time (saved_tensors_hooks), so the optimizer can update the one copy in place while microbatches
are in flight. Tensors derived from a weight (a cast, a product) keep their forward-time values.

T1, learning-rate rescheduling (--pipemare-lr-warmup-iters K): stage s steps batch b with
    lr_s(b) = lr(b) / tau_s ** (1 - min(b / K, 1))           (tau_s >= 1; K = 0: off)
T2, discrepancy correction (--pipemare-discrepancy-decay D): the stage keeps a moving average of
its updates, delta <- gamma * delta + (1 - gamma) * (W(b+1) - W(b)), gamma = D ** (1 / tau_s)
(delta starts at zero; a skipped step counts as a zero update), and the backward of microbatch k
reads the weights predicted back to its forward, W(b) - d_k * delta, computed per saved weight
when the backward needs it (a transient of that weight's size). This is our reading of the
paper's T2 (its body was not at hand); the multiplier is the microbatch's own delay d_k.

Memory: one working copy per stage (fp32: the master weights themselves) plus, with T2, delta:
fp32, the size of the stage's weights (every rank holds all of it, also with the distributed
optimizer, since the backward reads all of it).

Activation recomputation of whole layers is refused (config_checks.py): without stashing, a
recomputed forward would read newer weights than the forward it replays. Selective recomputation
re-runs the attention core only, which reads no weights.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_2bw.pipeline.weights import WeightVersions


def warmup_forwards(stage: int, stages: int) -> int:
    """w_s: the forwards stage s runs before its first backward in 1F1B."""
    return stages - 1 - stage


def forward_version(microbatch: int, microbatches: int, stage: int, stages: int,
                    first_batch: int = 0) -> int:
    """The weight version the forward of global microbatch k reads on `stage`."""
    return max((microbatch - warmup_forwards(stage, stages)) // microbatches, first_batch)


def microbatch_delay(microbatch: int, microbatches: int, stage: int, stages: int,
                     first_batch: int = 0) -> int:
    """d_k: updates between microbatch k's forward and its backward (which reads version b)."""
    return microbatch // microbatches - forward_version(microbatch, microbatches, stage, stages,
                                                        first_batch)


def stage_delay(microbatches: int, stage: int, stages: int) -> int:
    """tau_s = ceil(w_s / m): the largest delay of a microbatch on `stage` (p - 1 - s at m = 1)."""
    return -(-warmup_forwards(stage, stages) // microbatches)


def lr_factor(batch: int, warmup_iters: int, tau: int) -> float:
    """T1: what stage s's learning rate is multiplied by at the step of `batch`."""
    if warmup_iters <= 0 or tau < 1:
        return 1.0
    return 1.0 / tau ** (1.0 - min(batch / warmup_iters, 1.0))


def discrepancy_gamma(decay: float, tau: int) -> float:
    """T2's gamma_s = D ** (1 / tau_s) (0 where the stage has no delay)."""
    return decay ** (1.0 / tau) if tau >= 1 and decay > 0 else 0.0


class PipeMareWeights:
    """One stage's PipeMare state: T1's learning-rate factor, T2's delta, and the saved-tensor
    hooks through which a backward reads the weights. The updater calls `before_step` just before
    the optimizer steps, `after_step` once the new version is in the working copy (with the
    distributed optimizer, after its all-gather), `skipped_step` instead of both."""

    def __init__(self, versions: "WeightVersions", microbatches: int, stage: int, stages: int,
                 lr_warmup_iters: int = 0, discrepancy_decay: float = 0.0):
        if versions.capacity != 1:
            raise ValueError(f"PipeMare keeps one weight version per stage; the versions' rule "
                             f"holds {versions.capacity}")
        self.versions, self.m = versions, microbatches
        self.stage, self.stages = stage, stages
        self.tau = stage_delay(microbatches, stage, stages)
        self.lr_warmup_iters = lr_warmup_iters
        self.gamma = discrepancy_gamma(discrepancy_decay, self.tau)
        # T2 on a stage with a delay: the full stage's fp32 moving average of its updates
        self.delta = torch.zeros(versions.layout.total, dtype=torch.float32,
                                 device=versions.device) if self.gamma > 0 else None

    def _working(self, gathered: bool = True) -> torch.Tensor:
        """The stage's one working copy (also between a version's release and the next's
        creation, which reuse it); `gathered`: once the distributed optimizer's background
        all-gather of the newest version has landed (a backward or the step reads it)."""
        copy = self.versions.working_copies()[0]
        if gathered:
            self.versions.wait_gathers(copy)
        return copy.flat

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def before_step(self, batch: int, param_groups) -> None:
        """T1: scale every group's rate (the schedule set it for this step); T2: start the
        average's update from W(b), so delta = gamma*delta - (1-gamma)*W(b) until after_step."""
        factor = lr_factor(batch, self.lr_warmup_iters, self.tau)
        if factor != 1.0:
            for group in param_groups:
                group["lr"] *= factor
        if self.delta is not None:
            self.delta.mul_(self.gamma).sub_(self._working(), alpha=1.0 - self.gamma)

    @torch.no_grad()
    def after_step(self) -> None:
        if self.delta is not None:
            self.delta.add_(self._working(), alpha=1.0 - self.gamma)

    @torch.no_grad()
    def skipped_step(self) -> None:
        if self.delta is not None:
            self.delta.mul_(self.gamma)

    def tensors(self) -> list[torch.Tensor]:
        """What this object holds (memory accounting)."""
        return [] if self.delta is None else [self.delta]

    # -- the backward's weights ------------------------------------------------------------
    def hooks(self, delay: int):
        """Saved-tensor hooks (pack, unpack) for the forward of a microbatch whose backward comes
        `delay` updates later (d_k): each weight autograd saves (a view of the working copy) is
        read again when the backward needs it, as the newest version (minus d_k * delta)."""
        storage = self._working(gathered=False).untyped_storage().data_ptr()

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() != storage:
                return t
            return _SavedWeight(tuple(t.shape), t.stride(), t.storage_offset(), delay)

        def unpack(saved):
            if not isinstance(saved, _SavedWeight):
                return saved
            working = self._working()
            weight = working.as_strided(saved.shape, saved.stride, saved.offset)
            if self.delta is None or saved.delay == 0:
                return weight
            start = saved.offset - working.storage_offset()
            delta = self.delta.as_strided(saved.shape, saved.stride, start)
            return (weight.float() - saved.delay * delta).to(weight.dtype)

        return pack, unpack

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """T2's delta by parameter name (every data-parallel rank holds all of it)."""
        if self.delta is None:
            return {}
        v = self.versions
        return {"delta": {name: view.clone() for name, view in
                          zip(v.names, v.param_views(self.delta))}}

    @torch.no_grad()
    def load_state_dict(self, state: dict | None) -> None:
        """Restore delta; a checkpoint without it leaves delta at zero."""
        if self.delta is None:
            return
        self.delta.zero_()
        for view, name in zip(self.versions.param_views(self.delta), self.versions.names):
            if state and name in state.get("delta", {}):
                view.copy_(state["delta"][name])


class _SavedWeight:
    """A weight autograd saved: where it sits in the working copy, and the microbatch's delay."""
    __slots__ = ("shape", "stride", "offset", "delay")

    def __init__(self, shape, stride, offset, delay):
        self.shape, self.stride, self.offset, self.delay = shape, stride, offset, delay
