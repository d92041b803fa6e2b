"""Weight versions of one pipeline stage: fp32 master weights, the working-precision versions the
schedule's actions name, and the gradient-accumulation buffer.

- The optimizer owns the fp32 master weights, which always hold the newest version.
- A version is a list of leaf tensors in the working precision that autograd sees. `install(v)` puts
  version v's tensors into the module (swapping Parameter objects, never their storage), so a
  microbatch's backward differentiates exactly the weights its forward used.
- `create(v)` makes a new version from the master weights after a step, reusing the storage of a
  released version when there is one, so 2BW holds at most two working copies: one more than Flush.
- Gradients of every version accumulate into one flat buffer (`main_grad`, views per parameter):
  the schedule reduces a batch's gradients before any backward of the next batch runs.
- With fp32 and a single-version schedule the master weights are the working weights and the flat
  buffer is their .grad: no copy at all (Megatron's fp32 memory).
"""
from __future__ import annotations

import torch
from torch import nn


class WeightVersions:
    def __init__(self, module: nn.Module, working_dtype: torch.dtype, grad_dtype: torch.dtype,
                 single_version: bool):
        self.module = module
        self.working_dtype = working_dtype
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.specs = [p.spec for _, p in named]
        self._slots = []
        for name in self.names:
            owner_name, _, attr = name.rpartition(".")
            self._slots.append((module.get_submodule(owner_name), attr))
        originals = [p for _, p in named]
        self.alias = single_version and working_dtype == torch.float32 and grad_dtype == torch.float32
        device = originals[0].device
        total = sum(p.numel() for p in originals)
        self.main_grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        self.main_grads = self._views(self.main_grad_buffer, originals)
        if self.alias:
            self.master = originals
            for p, g in zip(self.master, self.main_grads):
                p.grad = g  # autograd accumulates in place into the flat buffer
            first = originals
        else:
            self.master = [nn.Parameter(p.detach().float().clone()) for p in originals]
            first = self._new_leaves()
        self.versions: dict[int, list[nn.Parameter]] = {0: first}
        self._free: list[list[nn.Parameter]] = []
        self.install(0)

    @staticmethod
    def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in like:
            views.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views

    def _new_leaves(self) -> list[nn.Parameter]:
        leaves = [nn.Parameter(m.detach().to(self.working_dtype, copy=True)) for m in self.master]
        for leaf, grad in zip(leaves, self.main_grads):
            if grad.dtype == leaf.dtype:
                leaf.grad = grad
            else:  # e.g. bf16 weights with fp32 accumulation: add each microbatch's gradient
                leaf.register_post_accumulate_grad_hook(_accumulate_into(grad))
        return leaves

    # -- versions ------------------------------------------------------------------------------
    @property
    def newest(self) -> int:
        return max(self.versions)

    @property
    def distinct_versions(self) -> int:
        return len({id(leaves) for leaves in self.versions.values()})

    def install(self, version: int) -> None:
        if version not in self.versions:
            raise RuntimeError(f"weight version {version} is not alive (alive: {sorted(self.versions)})")
        for (owner, attr), leaf in zip(self._slots, self.versions[version]):
            owner._parameters[attr] = leaf

    def release(self, version: int) -> None:
        leaves = self.versions.pop(version)
        if not self.alias and all(other is not leaves for other in self.versions.values()):
            self._free.append(leaves)

    @torch.no_grad()
    def create(self, version: int, skipped: bool = False) -> None:
        """Version `version` from the master weights (or, for a skipped step, the newest tensors)."""
        if skipped or self.alias:
            self.versions[version] = self.versions[self.newest] if self.versions else self.master
            return
        if self._free:
            leaves = self._free.pop()
            for leaf, m in zip(leaves, self.master):
                leaf.copy_(m)
        else:
            leaves = self._new_leaves()
        self.versions[version] = leaves

    def reset(self, newest: int, saved: dict[int, list[torch.Tensor]] | None = None) -> None:
        """Re-create the versions after the master weights were loaded: the saved working tensors
        of each version (a checkpoint's two 2BW versions), or version `newest` from the master."""
        self.versions.clear()
        self._free.clear()
        if self.alias or not saved:
            self.versions[newest] = self.master if self.alias else self._new_leaves()
        else:
            for version, tensors in sorted(saved.items()):
                leaves = self._new_leaves()
                with torch.no_grad():
                    for leaf, tensor in zip(leaves, tensors):
                        leaf.copy_(tensor)
                self.versions[version] = leaves
        self.install(self.newest)

    # -- bytes, for memory accounting ----------------------------------------------------------
    def working_bytes(self) -> int:
        distinct = {id(leaves): leaves for leaves in self.versions.values()}
        if self.alias:
            return 0
        return sum(p.numel() * p.element_size() for leaves in list(distinct.values()) + self._free
                   for p in leaves)


def _accumulate_into(main_grad: torch.Tensor):
    def hook(param: torch.Tensor) -> None:
        main_grad.add_(param.grad)
        param.grad = None
    return hook
