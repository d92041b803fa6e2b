"""Dropout randomness that is identical where activations are replicated over the tensor-parallel
group and independent where they are sharded, and that recomputation replays exactly.

The default generator is seeded alike on every tensor-parallel rank of a stage (replicated regions:
hidden dropout). `RngTracker.fork()` swaps in a per-tensor-parallel-rank generator state for sharded
regions (attention dropout on this rank's heads). `checkpoint()` saves both kinds of state at the
forward and restores them for the recomputation, so recomputed dropout masks equal the original ones.
"""
from __future__ import annotations

import random
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.utils.checkpoint


def _device_states() -> list[torch.Tensor]:
    # not in a process forked after its parent used CUDA (a CPU rank the test suite forks on a GPU
    # machine): CUDA cannot start there, and such a rank runs on the CPU
    usable = torch.cuda.is_available() and not torch.cuda._is_in_bad_fork()
    return [torch.cuda.get_rng_state()] if usable else []


def _set_device_states(states) -> None:
    if states:
        torch.cuda.set_rng_state(states[0])


class RngTracker:
    """Named RNG states kept aside from the default generator."""

    def __init__(self):
        self.states: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def add(self, name: str, seed: int) -> None:
        saved = torch.get_rng_state(), _device_states()
        torch.manual_seed(seed)
        self.states[name] = (torch.get_rng_state(), _device_states())
        torch.set_rng_state(saved[0])
        _set_device_states(saved[1])

    @contextmanager
    def fork(self, name: str = "tensor-parallel"):
        if name not in self.states:
            yield
            return
        outside = torch.get_rng_state(), _device_states()
        cpu, device = self.states[name]
        torch.set_rng_state(cpu)
        _set_device_states(device)
        try:
            yield
        finally:
            self.states[name] = (torch.get_rng_state(), _device_states())
            torch.set_rng_state(outside[0])
            _set_device_states(outside[1])

    def get_states(self) -> dict:
        return dict(self.states)

    def set_states(self, states: dict) -> None:
        self.states = dict(states)


_TRACKER = RngTracker()


def get_rng_tracker() -> RngTracker:
    return _TRACKER


def seed_everything(seed: int, tp_rank: int, pp_rank: int) -> None:
    """Megatron's convention: stages differ, tensor-parallel ranks share the default generator
    and differ in the tracker's generator."""
    base = seed + 100 * pp_rank
    random.seed(base)
    np.random.seed(base)
    torch.manual_seed(base)
    _TRACKER.states.clear()
    _TRACKER.add("tensor-parallel", base + 2718 + tp_rank)


def rng_state_dict() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(), "device": _device_states(),
            "tracker": _TRACKER.get_states()}


def load_rng_state_dict(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    _set_device_states(state["device"])
    _TRACKER.set_states(state["tracker"])


class _TrackerStates:
    """The tracker's states set for a block. Reusable: a graph kept for a split backward (B, then
    W) recomputes its checkpointed layers once per pass."""

    def __init__(self, states: dict):
        self.states, self._outside = states, []

    def __enter__(self) -> None:
        self._outside.append(_TRACKER.get_states())
        _TRACKER.set_states(self.states)

    def __exit__(self, *exc) -> bool:
        _TRACKER.set_states(self._outside.pop())
        return False


def checkpoint(function, *args):
    """Activation recomputation that also replays the tracker's RNG (torch replays the default one)."""
    forward_states = _TRACKER.get_states()

    def contexts():
        return nullcontext(), _TrackerStates(forward_states)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             preserve_rng_state=True, context_fn=contexts)
