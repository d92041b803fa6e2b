"""Autograd-aware communication at the borders of tensor-parallel regions (Megatron's f and g).

copy_to:     forward identity,        backward all-reduce (input of a column-parallel layer)
reduce_from: forward all-reduce,      backward identity   (output of a row-parallel layer)
scatter_to:  forward keep own chunk,  backward all-gather (last dimension)
gather_from: forward all-gather,      backward keep own chunk
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.distributed.comm import all_reduce, group_rank, group_size


def _all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _own_chunk_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=-1)[group_rank(group)].contiguous()


def _reduced(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.clone()
    all_reduce(x, group)
    return x


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduced(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_chunk_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad, ctx.group), None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk_last_dim(grad, ctx.group), None


def copy_to_tensor_parallel(x, group):
    return x if group_size(group) == 1 else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x, group):
    return x if group_size(group) == 1 else _ReduceFromTensorParallel.apply(x, group)


def scatter_to_tensor_parallel(x, group):
    return x if group_size(group) == 1 else _ScatterToTensorParallel.apply(x, group)


def gather_from_tensor_parallel(x, group):
    return x if group_size(group) == 1 else _GatherFromTensorParallel.apply(x, group)
