"""The torch optimizer over fp32 master weights: Megatron's weight-decay groups (no decay on biases
and norms, i.e. 1-D parameters) and apex's fused Adam when available on GPU."""
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


def build_torch_optimizer(params: list[torch.Tensor], opt: OptimizerConfig,
                          optimizer_class=None, **zero_kwargs) -> torch.optim.Optimizer:
    """`optimizer_class` lets the distributed optimizer wrap the same choice."""
    groups = param_groups(params, opt.weight_decay)
    if opt.optimizer == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": opt.lr, "momentum": opt.sgd_momentum}
    else:
        on_gpu = bool(params) and params[0].is_cuda
        if _ApexFusedAdam is not None and on_gpu:
            cls = _ApexFusedAdam
            kwargs = {"adam_w_mode": True}
        else:
            cls, kwargs = torch.optim.AdamW, {"foreach": True}
        kwargs.update(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
    if optimizer_class is not None:
        return optimizer_class(groups, optimizer_class=cls, **kwargs, **zero_kwargs)
    return cls(groups, **kwargs)
