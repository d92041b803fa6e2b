"""Delay compensation for asynchronous schedules
(--delay-compensation none|predict|dc|ef|nesterov).

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
ef       error-feedback correction of the optimizer's update (after Zmushko et al., arXiv
         2606.30634, Sec. 3), 2BW only, any optimizer. u_b = Opt(W(b), g_b) - W(b) is the step
         the optimizer takes with the stale gradient; the update applied adds back, with weight
         beta, how far that step moved since the last one (the error a one-step-stale update
         makes when updates change linearly):
             W(b+1) = W(b) + u_b + beta * (u_b - u_{b-1})        (u_{-1} = 0)
         State: u_{b-1} and one scratch buffer (two fp32 copies of this rank's shard).
nesterov Nesterov-style look-ahead (after Ajanthan et al., arXiv 2505.01099, Sec. 3), 2BW only.
         NAG steps from the look-ahead point y = W(b) + gamma * (W(b) - W(b-1)); under delay the
         gradient is not taken at y (it is the stale g_b, read at W(b-1)), only the step starts
         there:
             W(b+1) = Opt(W(b) + gamma * delta, g_b)             (momentum in weight space)
         where Opt is the configured optimizer's step (its own moments and weight decay apply
         at y). State: delta.

A skipped step (fp16 overflow) leaves the master weights alone: delta becomes zero and the new
version is the previous version's copy.

Memory: the fp32 delta, one buffer the size of this rank's master-weight shard (ef: two, its
scratch and u_{b-1}); with predict in fp32 the master weights also keep their own copy (a version
is no longer them). The working
versions themselves are 2BW's two.
"""
from __future__ import annotations

import torch

from megatron_2bw.pipeline.schedules import update_delay
from megatron_2bw.pipeline.flat_layout import gather_shards
from megatron_2bw.pipeline.weights import WeightVersions

MODES = ("none", "predict", "dc", "ef", "nesterov")
# the schedules each mode applies to: dc, ef and nesterov model a delay of exactly one update
COMPENSATED_SCHEDULES = {"predict": ("2bw", "pipedream", "pipedream-vs"), "dc": ("2bw",),
                         "ef": ("2bw",), "nesterov": ("2bw",)}
DC_DEFAULT_LAMBDA = 0.04  # DC-ASGD's constant lambda
# --delay-compensation-lambda's default per mode: dc's lambda, ef's beta, nesterov's gamma
DEFAULT_COEFFICIENT = {"dc": DC_DEFAULT_LAMBDA, "ef": 1.0, "nesterov": 0.5}
# fp32 buffers the size of this rank's master-weight shard each mode keeps (memory estimate)
STATE_BUFFERS = {"none": 0, "predict": 1, "dc": 1, "ef": 2, "nesterov": 1}


class DelayCompensation:
    """One stage's compensation state. The updater calls `before_step` after clipping (and after
    `WeightVersions.prepare_step`), `after_step` after the optimizer step, `skipped_step` instead
    of both; `WeightVersions.create` fills new versions through `version_source`."""

    def __init__(self, versions: WeightVersions, mode: str, coefficient: float | None = None):
        if mode not in MODES or mode == "none":
            raise ValueError(f"delay compensation {mode!r}: expected one of {MODES[1:]}")
        self.versions, self.mode = versions, mode
        rule = versions.rule
        # predict extrapolates over the stage's delay: its batches' gradients are applied tau
        # updates after the version they read (2BW: 1; PipeDream: p-1-s; vertical sync: p-1)
        self.scale = float(update_delay(rule.schedule, rule.stage, rule.stages))
        self.coefficient = DEFAULT_COEFFICIENT.get(mode) if coefficient is None else coefficient
        # after the distributed optimizer has sharded the master weights: their shard's size
        self.delta = [torch.zeros_like(region) for region in versions.master_regions]
        # ef: u_{b-1}, the optimizer's last step (without the correction)
        self.last_update = [torch.zeros_like(region) for region in versions.master_regions] \
            if mode == "ef" else []
        if mode == "predict":
            versions.version_source = self.predicted

    def predicted(self, index: int, master: torch.Tensor) -> torch.Tensor:
        """Region `index` of the next version: W + s * (W - W_previous)."""
        return torch.add(master, self.delta[index], alpha=self.scale)

    @torch.no_grad()
    def before_step(self) -> None:
        """dc: correct the master gradients to the newest weights; nesterov: move the master
        weights to the look-ahead point. Then remember W_old (in delta)."""
        v = self.versions
        for grad, master, delta in zip(v.master_grad_regions, v.master_regions, self.delta):
            if self.mode == "dc":
                grad.addcmul_(grad * grad, delta, value=self.coefficient)
            if self.mode == "nesterov":  # delta <- gamma*delta; W <- W + delta; delta <- W_old
                delta.mul_(self.coefficient)
                master.add_(delta)
                delta.sub_(master).neg_()
            else:
                delta.copy_(master)

    @torch.no_grad()
    def after_step(self) -> None:
        for i, (master, delta) in enumerate(zip(self.versions.master_regions, self.delta)):
            torch.sub(master, delta, out=delta)
            if self.mode == "ef":  # delta holds u_b: add beta * (u_b - u_{b-1})
                master.add_(delta, alpha=self.coefficient)
                master.sub_(self.last_update[i], alpha=self.coefficient)
                self.last_update[i].copy_(delta)

    @torch.no_grad()
    def skipped_step(self) -> None:
        """No update: delta and (ef) the last step are zero."""
        for buffer in self.delta + self.last_update:
            buffer.zero_()

    def tensors(self) -> list[torch.Tensor]:
        """What this object holds (memory accounting)."""
        return list(self.delta) + list(self.last_update)

    def _buffers(self) -> dict[str, list[torch.Tensor]]:
        """The state a checkpoint keeps, by name (delta is ef's scratch: not kept)."""
        return {"last_update": self.last_update} if self.mode == "ef" else {"delta": self.delta}

    # -- checkpoints ---------------------------------------------------------------------------
    @torch.no_grad()
    def full_state(self, dst: int | None = None) -> dict | None:
        """{"mode", and per buffer ("delta", or ef's "last_update") its per-parameter fp32
        tensors}. Sharded: a collective over the data-parallel group gathering on global rank
        `dst`; None on the other ranks."""
        v = self.versions
        state = {"mode": self.mode}
        for key, regions in self._buffers().items():
            shard = torch.cat(regions)
            if v.sharded:
                full = gather_shards(shard, v.layout, v.data_group, dst)
                if full is None:
                    return None
            else:
                full = torch.zeros(v.layout.total, dtype=shard.dtype, device=shard.device)
                for (a, b), region in zip(v.layout.owned, regions):
                    full[a:b] = region
            state[key] = {name: view.clone() for name, view in zip(v.names, v.param_views(full))}
        return state

    @torch.no_grad()
    def load_state(self, state: dict | None) -> None:
        """Restore the buffers (this rank's part of them); a buffer the checkpoint lacks starts
        at zero."""
        v = self.versions
        for key, regions in self._buffers().items():
            if not state or key not in state:
                for region in regions:
                    region.zero_()
                continue
            full = torch.zeros(v.layout.total, dtype=torch.float32, device=v.device)
            for name, view in zip(v.names, v.param_views(full)):
                view.copy_(state[key][name])
            for (a, b), region in zip(v.layout.owned, regions):
                region.copy_(full[a:b])


def build_delay_compensation(versions: WeightVersions, mode: str, coefficient: float | None
                             ) -> DelayCompensation | None:
    return None if mode == "none" else DelayCompensation(versions, mode, coefficient)
