"""Delay compensation for asynchronous schedules (--delay-compensation none|predict|dc).

Under 2BW batch b reads weight version b-1 while its gradient updates W(b), the newest master
weights: W(b+1) = W(b) - lr * update(g_b), g_b taken at version b-1, one step stale (PipeDream:
tau_s steps on stage s). Both remedies work from the last step's difference

    delta = W(v) - W(v-1)      (fp32, this rank's shard of the master weights)

which every step records (W(-1) = W(0): delta starts at zero).

predict  weight prediction, as SpecTrain and PipeOptim do. Version v is not W(v) but W(v)
         extrapolated along the optimizer's latest update over the stage's delay tau,
             version(v) = W(v) + tau * (W(v) - W(v-1)),
         tau = 1 under 2BW, p-1-s on stage s under PipeDream, p-1 under its vertical sync: the
         batch that reads version v takes its gradient near W(v+tau), the weights the gradient
         is applied to. The master weights stay exact; only the working copies the forward and
         backward read are predicted. Version 0 is W(0).
dc       delay-compensated gradients (DC-ASGD, Zheng et al. 2017), 2BW only. The gradient of batch b, read
         at W_read = W(b-1), is moved to W_new = W(b) by the diagonal of the outer-product
         approximation of the Hessian:
             g <- g + lambda * g * g * (W(b) - W(b-1))
         applied to the unscaled, clipped gradient just before the optimizer step (the clipping
         norm is the uncorrected gradient's, so the norm's all-reduce keeps its place).

A skipped step (fp16 overflow) leaves the master weights alone: delta becomes zero and the new
version is the previous version's copy.

Memory: the fp32 delta, one buffer the size of this rank's master-weight shard; with predict in
fp32 the master weights also keep their own copy (a version is no longer them). The working
versions themselves are 2BW's two.
"""
from __future__ import annotations

import torch

from megatron_2bw.pipeline.schedules import update_delay
from megatron_2bw.pipeline.flat_layout import gather_shards
from megatron_2bw.pipeline.weights import WeightVersions

MODES = ("none", "predict", "dc")
# the schedules each mode applies to: dc's W_read must be the version one update old
COMPENSATED_SCHEDULES = {"predict": ("2bw", "pipedream", "pipedream-vs"), "dc": ("2bw",)}
DC_DEFAULT_LAMBDA = 0.04  # DC-ASGD's constant lambda


class DelayCompensation:
    """One stage's compensation state. The updater calls `before_step` after clipping (and after
    `WeightVersions.prepare_step`), `after_step` after the optimizer step, `skipped_step` instead
    of both; `WeightVersions.create` fills new versions through `version_source`."""

    def __init__(self, versions: WeightVersions, mode: str, dc_lambda: float | None = None):
        if mode not in MODES or mode == "none":
            raise ValueError(f"delay compensation {mode!r}: expected one of {MODES[1:]}")
        self.versions, self.mode = versions, mode
        rule = versions.rule
        # predict extrapolates over the stage's delay: its batches' gradients are applied tau
        # updates after the version they read (2BW: 1; PipeDream: p-1-s; vertical sync: p-1)
        self.scale = float(update_delay(rule.schedule, rule.stage, rule.stages))
        self.dc_lambda = DC_DEFAULT_LAMBDA if dc_lambda is None else dc_lambda
        # after the distributed optimizer has sharded the master weights: their shard's size
        self.delta = [torch.zeros_like(region) for region in versions.master_regions]
        if mode == "predict":
            versions.version_source = self.predicted

    def predicted(self, index: int, master: torch.Tensor) -> torch.Tensor:
        """Region `index` of the next version: W + s * (W - W_previous)."""
        return torch.add(master, self.delta[index], alpha=self.scale)

    @torch.no_grad()
    def before_step(self) -> None:
        """dc: correct the master gradients to the newest weights. Then remember W_old."""
        v = self.versions
        for grad, master, delta in zip(v.master_grad_regions, v.master_regions, self.delta):
            if self.mode == "dc":
                grad.addcmul_(grad * grad, delta, value=self.dc_lambda)
            delta.copy_(master)

    @torch.no_grad()
    def after_step(self) -> None:
        for master, delta in zip(self.versions.master_regions, self.delta):
            torch.sub(master, delta, out=delta)

    @torch.no_grad()
    def skipped_step(self) -> None:
        for delta in self.delta:
            delta.zero_()

    def tensors(self) -> list[torch.Tensor]:
        """What this object holds (memory accounting)."""
        return list(self.delta)

    # -- checkpoints ---------------------------------------------------------------------------
    @torch.no_grad()
    def full_state(self, dst: int | None = None) -> dict | None:
        """{"mode", "delta": per-parameter fp32 tensors}. Sharded: a collective over the
        data-parallel group gathering on global rank `dst`; None on the other ranks."""
        v = self.versions
        shard = torch.cat(self.delta)
        if v.sharded:
            full = gather_shards(shard, v.layout, v.data_group, dst)
            if full is None:
                return None
        else:
            full = torch.zeros(v.layout.total, dtype=shard.dtype, device=shard.device)
            for (a, b), region in zip(v.layout.owned, self.delta):
                full[a:b] = region
        return {"mode": self.mode,
                "delta": {name: view.clone() for name, view in zip(v.names, v.param_views(full))}}

    @torch.no_grad()
    def load_state(self, state: dict | None) -> None:
        """Restore delta (this rank's part of it); a checkpoint without it leaves delta at zero."""
        if not state or "delta" not in state:
            for delta in self.delta:
                delta.zero_()
            return
        v = self.versions
        full = torch.zeros(v.layout.total, dtype=torch.float32, device=v.device)
        for name, view in zip(v.names, v.param_views(full)):
            view.copy_(state["delta"][name])
        for (a, b), delta in zip(v.layout.owned, self.delta):
            delta.copy_(full[a:b])


def build_delay_compensation(versions: WeightVersions, mode: str, dc_lambda: float | None
                             ) -> DelayCompensation | None:
    return None if mode == "none" else DelayCompensation(versions, mode, dc_lambda)
