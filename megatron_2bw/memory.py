"""Measured memory per rank: allocator statistics on GPU; on CPU, tracked allocations.

On CPU there is no allocator counter, so the peak is counted from the tensors themselves: the static
state (weights, versions, gradient buffers, optimizer state, counted once by storage) plus the
activations autograd saved for backward (counted through saved-tensor hooks, by storage, per
microbatch), taking the maximum over time of the sum of live microbatches' activations.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    states = getattr(optimizer, "optim", optimizer).state.values()
    return [v for state in states for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


class MemoryTracker:
    def __init__(self, device: torch.device):
        self.device = device
        self.static_bytes = 0
        self.live: dict[int, int] = {}  # microbatch -> saved activation bytes
        self.peak_activation_bytes = 0

    def set_static(self, tensors) -> None:
        self.static_bytes = storage_bytes(tensors)

    @contextmanager
    def track(self, microbatch: int):
        """Count the activations that the forward of `microbatch` saves for its backward."""
        seen: set[int] = set()
        count = [0]

        def pack(t: torch.Tensor):
            if not (t.is_leaf and t.requires_grad):  # weights are counted as static state
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    count[0] += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.live[microbatch] = self.live.get(microbatch, 0) + count[0]
        self.peak_activation_bytes = max(self.peak_activation_bytes, sum(self.live.values()))

    def release(self, microbatch: int) -> None:
        self.live.pop(microbatch, None)

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.static_bytes + self.peak_activation_bytes
