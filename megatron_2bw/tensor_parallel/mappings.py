"""Autograd-aware communication at the borders of tensor-parallel regions (Megatron's f and g).

copy_to:     forward identity,        backward all-reduce (input of a column-parallel layer)
reduce_from: forward all-reduce,      backward identity   (output of a row-parallel layer)
scatter_to:  forward keep own chunk,  backward all-gather (last dimension)
gather_from: forward all-gather,      backward keep own chunk
and, under sequence parallelism, the borders along the sequence (dimension 1 of [b, s, h]):
gather_from_sequence:         forward all-gather, backward reduce-scatter (or keep own part)
reduce_scatter_to_sequence:   forward reduce-scatter, backward all-gather

The collectives work in place or on one flat tensor (all_gather_into_tensor,
reduce_scatter_tensor): the all-reduces sum the tensor they are given, which autograd handed
over or `reduce_from` marks as modified. Along the sequence of [b, s, h] a rank's part is
contiguous only for b = 1 (Megatron-LM's usual micro-batch under --sequence-parallel), where
no copy changes the layout; for b > 1 one copy puts the sequence first and back.
"""
from __future__ import annotations

import torch

from megatron_2bw.distributed.comm import (ShardShapeGroup, all_gather_into_tensor, all_reduce,
                                           group_rank, group_size, reduce_scatter_tensor)


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _reduced(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group in place (a gradient autograd handed over, fresh from a matmul)."""
    all_reduce(x, group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if isinstance(group, ShardShapeGroup):  # the profiler times one rank: shapes only
        return torch.cat([x] * world, dim=dim)
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))  # the ranks' blocks along dim 0
    all_gather_into_tensor(out, x, group=group)
    out = out.view(world, *x.shape)
    # rank-major blocks to `dim`: a view wherever the dimensions before `dim` have size 1
    return out.movedim(0, dim % x.dim()).flatten(dim % x.dim(), dim % x.dim() + 1)


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
    """This rank's part of the sequence of the sum over the group."""
    return finish_reduce_scatter_sequence(*start_reduce_scatter_sequence(x, group))


def start_reduce_scatter_sequence(x: torch.Tensor, group):
    """Start reduce_scatter_sequence: (the part with the sequence first, the handle to wait on, or
    None where the result is there already); finish_reduce_scatter_sequence reads it."""
    world = group_size(group)
    if x.shape[1] % world:
        raise ValueError(f"sequence length {x.shape[1]} does not split over the {world} "
                         f"tensor-parallel ranks of --sequence-parallel")
    if isinstance(group, ShardShapeGroup):
        return _own_sequence_part(x, group).transpose(0, 1), None
    # reduce_scatter_tensor splits dimension 0: the sequence first (a view for b = 1)
    by_position = x.transpose(0, 1).contiguous()
    out = by_position.new_empty((by_position.shape[0] // world, *by_position.shape[1:]))
    return out, reduce_scatter_tensor(out, by_position, group=group, async_op=True)


def finish_reduce_scatter_sequence(out: torch.Tensor, handle) -> torch.Tensor:
    if handle is not None:
        handle.wait()
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


class _ReduceFrom(torch.autograd.Function):
    """Forward: the sum over the group, in place (the tensor is marked as modified, so autograd
    refuses should anything have saved it); backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_from_tensor_parallel(x, group):
    return x if group_size(group) == 1 else _ReduceFrom.apply(x, group)


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
