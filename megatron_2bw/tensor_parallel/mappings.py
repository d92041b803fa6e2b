"""Autograd-aware communication at the borders of tensor-parallel regions (Megatron's f and g).

copy_to:     forward identity,        backward all-reduce (input of a column-parallel layer)
reduce_from: forward all-reduce,      backward identity   (output of a row-parallel layer)
scatter_to:  forward keep own chunk,  backward all-gather (last dimension)
gather_from: forward all-gather,      backward keep own chunk
and, under sequence parallelism, the borders along the sequence (dimension 1 of [b, s, h]):
gather_from_sequence:         forward all-gather, backward reduce-scatter (or keep own part)
reduce_scatter_to_sequence:   forward reduce-scatter, backward all-gather
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.distributed.comm import (ShardShapeGroup, all_reduce, group_rank, group_size,
                                           reduce_scatter_tensor)


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _reduced(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone()
    all_reduce(x, group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if isinstance(group, ShardShapeGroup):  # the profiler times one rank: shapes only
        return torch.cat([x] * world, dim=dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _own_chunk(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


def _all_gather_last_dim(x, group):
    return _all_gather(x, group, -1)


def _own_chunk_last_dim(x, group):
    return _own_chunk(x, group, -1)


def all_gather_sequence(x, group):
    return _all_gather(x, group, 1)


def _own_sequence_part(x, group):
    return _own_chunk(x, group, 1)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if x.shape[1] % world:
        raise ValueError(f"sequence length {x.shape[1]} does not split over the {world} "
                         f"tensor-parallel ranks of --sequence-parallel")
    if isinstance(group, ShardShapeGroup):
        return _own_sequence_part(x, group)
    # reduce_scatter_tensor splits dimension 0: put the sequence first
    by_position = x.transpose(0, 1).contiguous()
    out = by_position.new_empty((by_position.shape[0] // world, *by_position.shape[1:]))
    reduce_scatter_tensor(out, by_position, group=group)
    return out.transpose(0, 1).contiguous()


class _Border(torch.autograd.Function):
    """y = forward_fn(x, group); dL/dx = backward_fn(dL/dy, group)."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def _border(x, group, forward_fn, backward_fn):
    return x if group_size(group) == 1 else _Border.apply(x, group, forward_fn, backward_fn)


def copy_to_tensor_parallel(x, group):
    return _border(x, group, _identity, _reduced)


def reduce_from_tensor_parallel(x, group):
    return _border(x, group, _reduced, _identity)


def scatter_to_tensor_parallel(x, group):
    return _border(x, group, _own_chunk_last_dim, _all_gather_last_dim)


def gather_from_tensor_parallel(x, group):
    return _border(x, group, _all_gather_last_dim, _own_chunk_last_dim)


def sequence_chunk(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's part of the sequence of a tensor every rank holds in full (plain slicing: the
    gradient of the other parts is zero here and comes from the other ranks)."""
    length = x.shape[1] // group_size(group)
    return x[:, group_rank(group) * length:(group_rank(group) + 1) * length]


def gather_from_sequence_parallel(x, group, partial_grad: bool = True):
    """Forward all-gather of the sequence. Backward: reduce-scatter when every rank's gradient is a
    partial sum (the input of a column-parallel layer), else each rank keeps its own part (the
    gradient is already whole on every rank, as after copy_to_tensor_parallel)."""
    return _border(x, group, all_gather_sequence,
                   reduce_scatter_sequence if partial_grad else _own_sequence_part)


def reduce_scatter_to_sequence_parallel(x, group):
    """Forward: sum the ranks' partial outputs and keep this rank's part of the sequence (a
    row-parallel layer's output, the vocabulary-parallel embedding's); backward all-gather."""
    return _border(x, group, reduce_scatter_sequence, all_gather_sequence)
