"""Measured memory per rank: allocator statistics on GPU; on CPU, tracked allocations.

On CPU there is no allocator counter, so the peak is counted from the tensors themselves: the static
state (weights, versions, gradient buffers, optimizer state, counted once by storage; all of it is
allocated when the stage is built) plus the activations each microbatch keeps for its backward:
what autograd saves (saved-tensor hooks) and the stage's output, which the executor holds until the
gradient comes back. The activation peak is the maximum over time of the sum over live microbatches.

That leaves out transient buffers (a layer's backward, the optimizer step's temporaries). Inside
`MemoryTracker.measure()` every tensor created is counted from its allocation to its release (a
torch dispatch mode: slower, for tests and profiling), and the peak then includes them, like the
GPU allocator's.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
    states = optimizer.state.values()
    return [v for state in states for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


def static_breakdown(versions, optimizer, compensation=(), stash=()) -> dict[str, int]:
    """Bytes of the stage's static state by kind, named like the planner's StageMemory fields:
    params (master weights + one working copy), grads (accumulation buffer + master gradients),
    optimizer (its state and `compensation`'s, --delay-compensation), versions_stash (the working
    copies beyond the first: 2BW's second, PipeDream's p - s - 1 more; and `stash`, PipeMare's
    T2 delta, which stands in for them)."""
    copies = versions.working_copies()
    in_copies = {c.flat.untyped_storage().data_ptr() for c in copies}
    # master gradients held in a free working copy (WeightVersions.grads_in_free_copy) are
    # counted with the copies
    grads = [g for g in versions.master_grad_regions
             if g.untyped_storage().data_ptr() not in in_copies]
    return {
        "params": storage_bytes(versions.master_regions + [copies[0].flat]),
        "grads": storage_bytes(grads + [versions.main_grad_buffer]),
        "optimizer": storage_bytes(optimizer_state_tensors(optimizer) + list(compensation)),
        "versions_stash": storage_bytes([c.flat for c in copies[1:]] + list(stash)),
    }


class _LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages that the operators run inside create, while they are alive."""

    def __init__(self, counted_elsewhere: set[int]):
        super().__init__()
        self.counted_elsewhere = counted_elsewhere
        self.sizes: dict[int, int] = {}  # storage address -> bytes, for live storages
        self.total = self.peak = 0

    def _released(self, address: int) -> None:
        self.total -= self.sizes.pop(address, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                address = storage.data_ptr()
                if address and address not in self.sizes and address not in self.counted_elsewhere:
                    self.sizes[address] = storage.nbytes()
                    self.total += storage.nbytes()
                    weakref.finalize(storage, self._released, address)
        self.peak = max(self.peak, self.total)
        return out


class MemoryTracker:
    def __init__(self, device: torch.device):
        self.device = device
        self.static_bytes = 0
        self._static_storages: set[int] = set()
        self.live: dict[int, int] = {}  # microbatch -> activation bytes it keeps
        self._bytes_by_signature: dict[object, int] = {}
        self.peak_activation_bytes = 0
        self.peak_measured_bytes = 0  # inside measure(): everything beyond the static state

    def set_static(self, tensors) -> None:
        tensors = [t for t in tensors if t is not None]
        self.static_bytes = storage_bytes(tensors)
        self._static_storages = {t.untyped_storage().data_ptr() for t in tensors}

    @contextmanager
    def track(self, microbatch: int, signature=None, saved_hooks=None):
        """Count the activations that the forward of `microbatch` keeps for its backward.
        `saved_hooks`: (pack, unpack) saved-tensor hooks of the caller's, applied after counting.

        Microbatches with the same `signature` (the shapes and dtypes that go in) keep the same
        bytes, so only the first of each is counted: counting every one slowed the forward and
        backward of a small GPT's pipeline stage on CPU by about 4% (micro batch 2)."""
        known = self._bytes_by_signature.get(signature) if signature is not None else None
        outer_pack, outer_unpack = saved_hooks or (lambda t: t, lambda t: t)
        if known is not None:
            if saved_hooks is None:
                yield
            else:
                with torch.autograd.graph.saved_tensors_hooks(*saved_hooks):
                    yield
            self._keep(microbatch, known)
            return
        seen: set[int] = set()
        count = [0]

        def add(t: torch.Tensor) -> None:
            if isinstance(t, nn.Parameter):  # weights are static state
                return
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen and key not in self._static_storages:
                seen.add(key)
                count[0] += storage.nbytes()

        def pack(t: torch.Tensor):
            add(t)
            return outer_pack(t)

        outermost = []  # module forward hooks fire innermost first: the stage's module comes last

        def on_forward(module, inputs, output):
            outermost[:] = [output]

        hook = nn.modules.module.register_module_forward_hook(on_forward)
        try:
            # compiled layers (--torch-compile) run this counted microbatch eagerly: the hooks
            # see every saved tensor, and the compiled graphs never trace (and re-trace) them
            with torch.compiler.set_stance("force_eager"), \
                    torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
                yield
        finally:
            hook.remove()
        output = outermost[0] if outermost else None
        for t in output if isinstance(output, tuple) else [output]:
            if torch.is_tensor(t):
                add(t)
        if signature is not None:
            self._bytes_by_signature[signature] = count[0]
        self._keep(microbatch, count[0])

    def _keep(self, microbatch: int, nbytes: int) -> None:
        self.live[microbatch] = self.live.get(microbatch, 0) + nbytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, sum(self.live.values()))

    def release(self, microbatch: int) -> None:
        self.live.pop(microbatch, None)

    @contextmanager
    def measure(self):
        """CPU: count every tensor created in the block, transients included."""
        if self.device.type == "cuda":  # the allocator counts already
            yield
            return
        live = _LiveTensorBytes(self._static_storages)
        with live:
            yield
        self.peak_measured_bytes = max(self.peak_measured_bytes, live.peak)

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.static_bytes + max(self.peak_activation_bytes, self.peak_measured_bytes)
