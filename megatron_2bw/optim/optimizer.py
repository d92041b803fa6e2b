"""The torch optimizer over fp32 master weights: Megatron's weight-decay groups (no decay on biases
and norms, i.e. 1-D parameters) and apex's fused Adam when available on GPU, else torch's fused
AdamW/SGD (one kernel per tensor list and no temporary of the parameters' size; the foreach path
would hold sqrt(v), 4 bytes per parameter, during every step)."""
from __future__ import annotations

import torch

from megatron_2bw.config import OptimizerConfig

try:
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except Exception:  # noqa: BLE001 - any import failure means "no apex"
    _ApexFusedAdam = None


def param_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def build_torch_optimizer(params: list[torch.Tensor],
                          opt: OptimizerConfig) -> torch.optim.Optimizer:
    groups = param_groups(params, opt.weight_decay)
    if opt.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.sgd_momentum, fused=True)
    adam = dict(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
    if _ApexFusedAdam is not None and bool(params) and params[0].is_cuda:
        return _ApexFusedAdam(groups, adam_w_mode=True, **adam)
    return torch.optim.AdamW(groups, fused=True, **adam)


@torch.no_grad()
def initialize_state(optimizer) -> None:
    """Create the optimizer state now instead of at the first step, so that a stage holds from the
    start what it holds at its peak (memory accounting counts it; an out-of-memory shows at once).

    Call it while the gradients are zero (or None). One step at learning rate 0 moves no weight
    and makes every optimizer allocate its state; zeroing that state (step counters included)
    leaves exactly a fresh optimizer: Adam's moments start at 0, and SGD's momentum buffer then
    becomes the first gradient, as when torch creates it."""
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    absent = [p for p in params if p.grad is None]
    for p in absent:
        p.grad = torch.zeros_like(p)
    rates = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, rate in zip(groups, rates):
        g["lr"] = rate
        if "step" in g:  # apex keeps its step counter per group
            g["step"] = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                value.zero_()
    for p in absent:
        p.grad = None
