"""The distributed optimizer (--use-distributed-optimizer): ZeRO stage 1 over the data-parallel
replicas of a stage. Each of the d replicas keeps 1/d of the fp32 master weights, of their gradients
and of the optimizer state.

The stage's flat buffers are split into d equal shards (pipeline/flat_layout.py). Per
batch the gradient buffer is reduce-scattered (pipeline/update.py), each rank steps a plain torch
optimizer over its shard of every parameter, and the next weight version is all-gathered from the
shards (WeightVersions.create). torch's ZeroRedundancyOptimizer is not used: it assigns whole
parameters to ranks and broadcasts them into full-size parameters, so every rank would still hold
all the master weights.

A checkpoint sees the optimizer of an unsharded run: `consolidate_state_dict(to)` gathers the full
state on one rank, whose `state_dict()` then has torch's format over full-size parameters, and
`load_state_dict` takes such a state (from a sharded run or not, any d) and keeps this rank's part.
"""
from __future__ import annotations

import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.optim.optimizer import build_torch_optimizer
from megatron_2bw.pipeline.flat_layout import gather_shards
from megatron_2bw.pipeline.weights import WeightVersions


class DistributedOptimizer:
    """A torch optimizer over this rank's part of the master weights, with the state dictionary of
    the unsharded optimizer for checkpoints."""

    def __init__(self, optimizer: torch.optim.Optimizer, data_group):
        self.optimizer, self.data_group = optimizer, data_group
        self.versions: WeightVersions | None = None
        self._consolidated: dict | None = None

    def shard(self, versions: WeightVersions) -> None:
        """Shard the master weights the optimizer was built over (before its state exists); the
        optimizer keeps the same Parameter objects, which now view this rank's part."""
        if any(self.optimizer.state.values()):
            raise RuntimeError("shard the master weights before the optimizer state exists")
        versions.shard(self.data_group)
        self.versions = versions

    # -- what the updater uses -------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self) -> None:
        self._consolidated = None
        self.optimizer.step()

    # -- checkpoints -----------------------------------------------------------------------------
    def _index_of(self) -> dict[int, int]:
        return {id(m): i for i, m in enumerate(self.versions.master)}

    @torch.no_grad()
    def consolidate_state_dict(self, to: int) -> None:
        """Collective over the data-parallel group: gather the full state on global rank `to`."""
        versions = self.versions
        index_of = self._index_of()
        local = self.optimizer.state_dict()
        ordered = [p for g in self.optimizer.param_groups for p in g["params"]]
        # per-element state: Adam's m and v, Muon's momentum buffer (each parameter has the keys
        # of its group's rule; every rank holds the same keys, for its parts)
        keys = sorted({k for s in local["state"].values() for k, v in s.items()
                       if torch.is_tensor(v) and v.dim() > 0})
        full_state = {i: dict(s) for i, s in local["state"].items()}
        for key in keys:
            holders = [position for position in range(len(ordered))
                       if key in local["state"].get(position, {})]
            shard = torch.zeros(versions.layout.shard_numel, dtype=torch.float32,
                                device=versions.device)
            for position in holders:
                part = versions.layout.owned_part(index_of[id(ordered[position])])
                shard[part.position:part.position + part.numel] = local["state"][position][key]
            full = gather_shards(shard, versions.layout, self.data_group, to)
            if full is not None:
                views = versions.param_views(full)
                for position in holders:
                    full_state[position][key] = views[index_of[id(ordered[position])]].clone()
        is_target = torch.distributed.get_rank() == to
        self._consolidated = ({"state": full_state, "param_groups": local["param_groups"]}
                              if is_target else None)

    def state_dict(self) -> dict:
        """torch's optimizer state over full-size parameters (after consolidate_state_dict)."""
        if self._consolidated is None:
            raise RuntimeError("the distributed optimizer's state is sharded: call "
                               "consolidate_state_dict(to=rank) on every data-parallel rank first, "
                               "then state_dict() on that rank")
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Take this rank's part of a full-size state (see state_dict)."""
        index_of = self._index_of()
        ordered = [p for g in self.optimizer.param_groups for p in g["params"]]
        shards = {}
        for position, entries in state_dict["state"].items():
            p = ordered[position]
            part = self.versions.layout.owned_part(index_of[id(p)])
            shards[position] = {
                key: value.reshape(-1)[part.lo:part.hi].clone()
                if torch.is_tensor(value) and value.dim() > 0 else value
                for key, value in entries.items()}
        self.optimizer.load_state_dict({"state": shards,
                                        "param_groups": state_dict["param_groups"]})
        self._consolidated = None


def build_distributed_optimizer(master_params: list[torch.Tensor], opt: OptimizerConfig,
                                data_group, names: list[str] | None = None) -> DistributedOptimizer:
    """The optimizer of `build_torch_optimizer` (same groups, decided on the full parameters), to
    be sharded over `data_group` by the GradientUpdater before its first step."""
    return DistributedOptimizer(build_torch_optimizer(master_params, opt, names), data_group)
