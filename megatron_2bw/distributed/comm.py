"""Collectives that are no-ops on a group of one (None means "no peers")."""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives; the old names still exist, but warn
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardShapeGroup:
    """Stands in for a tensor-parallel group of `size` when one process times one rank's shard
    (the planner's profiler): layers take their shard shapes from it, and collectives over it do
    nothing (the cost model adds their time)."""

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank = size, rank


def group_size(group) -> int:
    if group is None:
        return 1
    return group.size if isinstance(group, ShardShapeGroup) else dist.get_world_size(group)


def group_rank(group) -> int:
    if group is None:
        return 0
    return group.rank if isinstance(group, ShardShapeGroup) else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    if group_size(group) == 1 or isinstance(group, ShardShapeGroup):
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
