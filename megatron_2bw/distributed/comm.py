"""Collectives that are no-ops on a group of one (None means "no peers")."""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    if group_size(group) == 1:
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
