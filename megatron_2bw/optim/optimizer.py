"""The torch optimizer over fp32 master weights: Megatron's parameter groups and apex's fused Adam
when available on GPU, else torch's fused AdamW/SGD (one kernel per tensor list and no temporary of
the parameters' size; the foreach path would hold sqrt(v), 4 bytes per parameter, during every
step); with --optimizer muon, Muon for the hidden matrices and that AdamW for the rest
(optim/muon.py).

Each group carries what the schedules (optim/lr_schedule.py `apply_schedule`) need, under
Megatron-LM's names: `wd_mult` (1: weight decay, 0: none, for biases and norms, i.e. 1-D
parameters) and `is_decoupled_lr` (the input embeddings and the output layer under --decoupled-lr,
which then have groups of their own), and `use_muon` (Muon's group). These roles come from this run's parameters and flags:
loading an optimizer state leaves them as they are (a checkpoint's groups may come from another
configuration)."""
from __future__ import annotations

import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.optim.muon import Muon

try:
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except Exception:  # noqa: BLE001 - any import failure means "no apex"
    _ApexFusedAdam = None

GROUP_ROLES = ("wd_mult", "is_decoupled_lr", "use_muon")
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_LAYER_WEIGHTS = ("output_embedding", "output_layer")  # the last stage's tied copy; untied
OUTPUT_HEADS = ("binary_head.weight", "classifier.weight")  # BERT's; the GLUE classifier's


def is_embedding_or_output(name: str) -> bool:
    """Megatron-LM's `is_embedding_or_output_parameter`: the input word embeddings (the first
    stage's; the classifier's encoder's) and the output layer's weight (the last stage's tied copy
    of the word embeddings or its untied output layer). As in Megatron, not the position or
    token-type embeddings, nor BERT's output bias."""
    return name == WORD_EMBEDDINGS or name.endswith("." + WORD_EMBEDDINGS) \
        or name in OUTPUT_LAYER_WEIGHTS


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """What Muon updates: a 2-D weight of a hidden layer (not an embedding, the output layer or a
    classification head, whose rows are per-token or per-class vectors rather than a linear map
    between hidden representations)."""
    return param.dim() == 2 and "embedding" not in name and not is_embedding_or_output(name) \
        and not name.endswith(OUTPUT_HEADS)


def param_groups(params: list[torch.Tensor], opt: OptimizerConfig,
                 names: list[str] | None = None) -> list[dict]:
    """Megatron's groups: decayed or not, times (with --decoupled-lr) main or decoupled schedule;
    with --optimizer muon the hidden matrices form a decayed main group of their own (`use_muon`).
    `names` (the parameters' module names) pick the decoupled ones and Muon's matrices."""
    muon = opt.optimizer == "muon"
    for needed, flag in ((opt.decoupled_lr is not None, "--decoupled-lr"),
                         (muon, "--optimizer muon")):
        if needed and names is None:
            raise ValueError(f"{flag}: the optimizer needs the parameters' names to find the "
                             f"embedding and output-layer weights")
    decoupled = ([is_embedding_or_output(name) for name in names] if opt.decoupled_lr is not None
                 else [False] * len(params))
    matrix = ([is_hidden_matrix(name, p) for name, p in zip(names, params, strict=True)] if muon
              else [False] * len(params))
    groups = []
    if any(matrix):
        groups.append({"params": [p for p, is_matrix in zip(params, matrix) if is_matrix],
                       "weight_decay": opt.weight_decay, "wd_mult": 1.0, "is_decoupled_lr": False,
                       "use_muon": True})
    for is_decoupled_lr in (False, True):
        for wd_mult in (1.0, 0.0):
            members = [p for p, d, is_matrix in zip(params, decoupled, matrix, strict=True)
                       if d == is_decoupled_lr and (p.dim() > 1) == bool(wd_mult)
                       and not is_matrix]
            if members:
                groups.append({"params": members, "weight_decay": opt.weight_decay * wd_mult,
                               "wd_mult": wd_mult, "is_decoupled_lr": is_decoupled_lr,
                               "use_muon": False})
    return groups


def _keep_group_roles(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """load_state_dict pre-hook: the loaded groups take their roles from this optimizer's."""
    state_dict["param_groups"] = [{**saved, **{key: group[key] for key in GROUP_ROLES}}
                                  for saved, group in zip(state_dict["param_groups"],
                                                          optimizer.param_groups)]
    return state_dict


def build_torch_optimizer(params: list[torch.Tensor], opt: OptimizerConfig,
                          names: list[str] | None = None) -> torch.optim.Optimizer:
    groups = param_groups(params, opt, names)
    adam = dict(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
    if opt.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=opt.lr, momentum=opt.sgd_momentum, fused=True)
    elif opt.optimizer == "muon":
        optimizer = Muon(groups, momentum=opt.muon_momentum, nesterov=opt.muon_use_nesterov,
                         ns_steps=opt.muon_num_ns_steps, scale_mode=opt.muon_scale_mode,
                         extra_scale_factor=opt.muon_extra_scale_factor, fused=True, **adam)
    else:
        if _ApexFusedAdam is not None and bool(params) and params[0].is_cuda:
            optimizer = _ApexFusedAdam(groups, adam_w_mode=True, **adam)
        else:
            optimizer = torch.optim.AdamW(groups, fused=True, **adam)
    optimizer.register_load_state_dict_pre_hook(_keep_group_roles)
    return optimizer


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
