"""Muon (--optimizer muon) for the hidden weight matrices, AdamW for every other parameter.

Muon's update of a matrix W with gradient G is torch.optim.Muon's (Jordan et al., "Muon: An
optimizer for hidden layers in neural networks", 2024; Liu et al., "Muon is Scalable for LLM
Training", arXiv 2502.16982):

    B <- mu * B + (1 - mu) * G                        (the momentum buffer, one per matrix)
    U <- (1 - mu) * G + mu * B   with Nesterov, else B
    O <- NS_k(U)                                      (k quintic Newton-Schulz steps, in bf16)
    W <- W * (1 - lr * wd) - lr * scale(shape) * O

`scale` is Megatron-Core's --muon-scale-mode times --muon-extra-scale-factor: shape_scaling
sqrt(max(1, out / in)) is torch's default ("original"), spectral sqrt(max(out, in)) with a factor
0.2 is torch's "match_rms_adamw" (Moonshot's RMS match to AdamW), unit_rms_norm sqrt(out / in).

NS orthogonalises the whole matrix, not a piece of it. Where a rank holds only part of a matrix
(tensor parallelism: a column or row shard; the distributed optimizer: a flat slice of that
shard), `WholeMatrices` assembles every matrix's update U in full on every rank of the stage's
data- and tensor-parallel groups (one all-gather of the shard over the data-parallel group, one
all-gather per partitioned matrix over the tensor-parallel group), each rank runs NS on it and
keeps the part of O its weights need. The momentum buffer stays as sharded as the weights.

The other parameters (embeddings, the output layer, norms, biases) take AdamW's step, configured
by the Adam flags, exactly as with --optimizer adam: this class is torch's fused AdamW over those
groups, so its state dictionary is torch's (momentum_buffer for a matrix, exp_avg and exp_avg_sq
for the rest)."""
from __future__ import annotations

import math

import torch

from megatron_2bw.config import MUON_SCALE_MODES
from megatron_2bw.distributed.comm import group_rank, group_size

# Keller Jordan's quintic coefficients (as torch.optim.Muon), chosen for the slope at zero
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(update: torch.Tensor, steps: int,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """The approximate orthogonalisation U S' V^T of update = U S V^T, S' about 1 (bf16)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def update_scale(shape: tuple[int, int], mode: str, extra: float) -> float:
    """The factor on the learning rate for a matrix of `shape` (out, in): see the module doc."""
    out, inp = shape[0], shape[1]
    if mode == "shape_scaling":
        ratio = math.sqrt(max(1.0, out / inp))
    elif mode == "spectral":
        ratio = math.sqrt(max(out, inp))
    elif mode == "unit_rms_norm":
        ratio = math.sqrt(out / inp)
    else:
        raise ValueError(f"--muon-scale-mode {mode}: expected one of {', '.join(MUON_SCALE_MODES)}")
    return ratio * extra


class WholeMatrices:
    """Assembles whole matrices from this rank's parts, and cuts this rank's part back out.

    A parameter's `spec` (tensor_parallel/layers.ParamSpec) says how `tensor_group` splits it;
    `versions` (pipeline/weights.WeightVersions), once the distributed optimizer has sharded the
    master weights, says which flat slice of it this rank owns. Without either every parameter is
    whole."""

    def __init__(self, tensor_group=None, versions=None):
        self.tensor_group = tensor_group
        self.sharded = versions if versions is not None and versions.sharded else None
        self.index = {} if versions is None else {id(m): i for i, m in enumerate(versions.master)}

    @staticmethod
    def full_shape(param: torch.Tensor) -> tuple[int, int]:
        spec = getattr(param, "spec", None)
        return tuple(param.shape) if spec is None else tuple(spec.full_shape)

    def _partition(self, param: torch.Tensor) -> int | None:
        spec = getattr(param, "spec", None)
        if spec is None or group_size(self.tensor_group) == 1:
            return None
        return spec.partition_dim

    def gather(self, params: list[torch.Tensor], parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every param's whole matrix from this rank's `parts` of it (collectives over the data-
        and tensor-parallel groups, in the same order on every rank)."""
        v = self.sharded
        if v is not None:
            from megatron_2bw.pipeline.flat_layout import gather_shards
            shard = torch.zeros(v.layout.shard_numel, dtype=torch.float32, device=v.device)
            for p, part in zip(params, parts):
                owned = v.layout.owned_part(self.index[id(p)])
                shard[owned.position:owned.position + owned.numel] = part.reshape(-1)
            views = v.param_views(gather_shards(shard, v.layout, v.data_group, None))
            parts = [views[self.index[id(p)]] for p in params]
        whole = []
        for p, part in zip(params, parts):
            dim = self._partition(p)
            if dim is None:
                whole.append(part)
                continue
            pieces = [torch.empty_like(part) for _ in range(group_size(self.tensor_group))]
            torch.distributed.all_gather(pieces, part.contiguous(), group=self.tensor_group)
            whole.append(torch.cat(pieces, dim=dim))
        return whole

    def local(self, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of `whole`, shaped like `param`."""
        dim = self._partition(param)
        if dim is not None:
            whole = whole.chunk(group_size(self.tensor_group), dim=dim)[
                group_rank(self.tensor_group)]
        if self.sharded is not None:
            owned = self.sharded.layout.owned_part(self.index[id(param)])
            return whole.reshape(-1)[owned.lo:owned.hi]
        return whole


class Muon(torch.optim.AdamW):
    """Muon for the groups with `use_muon` (2-D parameters), torch's AdamW for the others.

    `whole_matrices` (WholeMatrices) is set by the stage once its master weights are laid out."""

    def __init__(self, groups: list[dict], *, lr: float, momentum: float, nesterov: bool,
                 ns_steps: int, scale_mode: str, extra_scale_factor: float, **adam):
        for group in groups:
            group.setdefault("use_muon", False)
            if group["use_muon"]:
                group.update(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                             scale_mode=scale_mode, extra_scale_factor=extra_scale_factor)
                flat = [tuple(p.shape) for p in group["params"] if p.dim() != 2]
                if flat:
                    raise ValueError(f"Muon updates 2-D matrices, not parameters of shape {flat}")
        super().__init__(groups, lr=lr, **adam)
        self.whole_matrices = WholeMatrices()

    def __setstate__(self, state):
        # (load_state_dict) Adam's setup reads every parameter's step count: show it its groups
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups
                                                        if not g.get("use_muon")]})
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g["use_muon"]]
        try:
            loss = super().step(closure) if self.param_groups else None
        finally:
            self.param_groups = groups
        for group in groups:
            if group["use_muon"]:
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buffer = state["momentum_buffer"]
            buffer.lerp_(p.grad, 1 - group["momentum"])
            updates.append(p.grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer)
        whole = self.whole_matrices.gather(params, updates)
        lr, decay = group["lr"], group["weight_decay"]
        for p, matrix in zip(params, whole):
            orthogonal = newton_schulz(matrix, group["ns_steps"])
            shape = self.whole_matrices.full_shape(p)
            rate = lr * update_scale(shape, group["scale_mode"], group["extra_scale_factor"])
            # through .data, as torch's fused AdamW writes: a master weight can share its version
            # counter with another version's working copy (pipeline/weights.py moves it between
            # copies), whose saved tensors autograd would otherwise take for modified
            weight = p.data
            weight.mul_(1 - lr * decay)
            weight.add_(self.whole_matrices.local(p, orthogonal), alpha=-rate)
