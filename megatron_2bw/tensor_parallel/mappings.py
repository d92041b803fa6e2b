"""Autograd-aware communication at the borders of tensor-parallel regions (Megatron's f and g).

copy_to:     forward identity,        backward all-reduce (input of a column-parallel layer)
reduce_from: forward all-reduce,      backward identity   (output of a row-parallel layer)
scatter_to:  forward keep own chunk,  backward all-gather (last dimension)
gather_from: forward all-gather,      backward keep own chunk
and, under sequence parallelism, the same borders along the sequence (below).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.distributed.comm import (ShardShapeGroup, all_reduce, group_rank, group_size,
                                           reduce_scatter_tensor)


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


# -- sequence parallelism: activations outside the tensor-parallel regions split along the sequence
# (dimension 1 of [b, s, h]) over the same group (Megatron-LM's --sequence-parallel).

def _all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if isinstance(group, ShardShapeGroup):  # the profiler times one rank: shapes only
        return torch.cat([x] * world, dim=1)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if x.shape[1] % world:
        raise ValueError(f"sequence length {x.shape[1]} does not split over the {world} "
                         f"tensor-parallel ranks of --sequence-parallel")
    if isinstance(group, ShardShapeGroup):
        return x.chunk(world, dim=1)[group_rank(group)].contiguous()
    # reduce_scatter_tensor splits dimension 0: put the sequence first
    chunks = x.transpose(0, 1).contiguous()
    out = chunks.new_empty((chunks.shape[0] // world, *chunks.shape[1:]))
    reduce_scatter_tensor(out, chunks, group=group)
    return out.transpose(0, 1).contiguous()


def sequence_chunk(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's part of the sequence of a tensor every rank holds in full (plain slicing: the
    gradient of the other parts is zero here and comes from the other ranks)."""
    world = group_size(group)
    length = x.shape[1] // world
    return x[:, group_rank(group) * length:(group_rank(group) + 1) * length]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, partial_grad):
        ctx.group, ctx.partial_grad = group, partial_grad
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial_grad:  # each rank's part of the gradient (a column-parallel layer's input)
            return _reduce_scatter_sequence(grad, ctx.group), None, None
        return sequence_chunk(grad, ctx.group).contiguous(), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group), None


def gather_from_sequence_parallel(x, group, partial_grad: bool = True):
    """Forward all-gather of the sequence. Backward: reduce-scatter when every rank's gradient is a
    partial sum (the input of a column-parallel layer), else each rank keeps its own part (the
    gradient is already whole on every rank, as after copy_to_tensor_parallel)."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, group, partial_grad)


def reduce_scatter_to_sequence_parallel(x, group):
    """Forward: sum the ranks' partial outputs and keep this rank's part of the sequence (a
    row-parallel layer's output, the vocabulary-parallel embedding's); backward all-gather."""
    return x if group_size(group) == 1 else _ReduceScatterSequence.apply(x, group)
