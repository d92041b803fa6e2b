"""Drop-in tensor-parallel layers (Megatron's design): column- and row-parallel linear layers and a
vocabulary-parallel embedding. With a group of one they are plain layers.

Every parameter carries a `ParamSpec` describing its full (unsharded) shape, which dimension is
split over the tensor-parallel group and how to initialise it, so that initialisation, gradient-norm
counting, checkpoint resharding and export never need to know the layer classes.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_2bw.distributed.comm import all_reduce, group_rank, group_size
from megatron_2bw.tensor_parallel.mappings import (
    all_gather_sequence, copy_to_tensor_parallel, finish_reduce_scatter_sequence,
    gather_from_tensor_parallel, reduce_from_tensor_parallel, reduce_scatter_to_sequence_parallel,
    scatter_to_tensor_parallel, start_reduce_scatter_sequence)


@dataclass
class ParamSpec:
    full_shape: tuple[int, ...]
    partition_dim: int | None = None  # None: replicated over the tensor-parallel group
    tp_rank: int = 0
    tp_size: int = 1
    init: str = "normal"  # normal | output (std / sqrt(2 * layers)) | zeros | ones
    init_name: str | None = None  # overrides the parameter's name for seeding (tied copies)
    tied: bool = False  # word embeddings shared by the first and last pipeline stage
    tied_copy: bool = False  # the last stage's copy: excluded from the grad norm (counted once)
    # replicated, but each tensor-parallel rank's gradient covers only its part of the work (its
    # part of the sequence under --sequence-parallel; its heads for --qk-layernorm's norms): the
    # gradients are summed over the tensor-parallel group
    tensor_partial_grad: bool = False

    @property
    def replicated(self) -> bool:
        return self.partition_dim is None


def make_param(full_shape, group, partition_dim: int | None, init: str) -> nn.Parameter:
    tp_size, tp_rank = group_size(group), group_rank(group)
    shape = list(full_shape)
    if partition_dim is not None:
        if shape[partition_dim] % tp_size:
            raise ValueError(f"dimension {shape[partition_dim]} is not divisible by the "
                             f"tensor-parallel size {tp_size}")
        shape[partition_dim] //= tp_size
    param = nn.Parameter(torch.empty(shape))
    param.spec = ParamSpec(tuple(full_shape), partition_dim, tp_rank, tp_size, init)
    return param


def replicated_param(full_shape, init: str) -> nn.Parameter:
    return make_param(full_shape, None, None, init)


INIT_CHUNK_ELEMENTS = 1 << 22  # host memory of the initialiser: one chunk, not a full tensor


@torch.no_grad()
def initialize_parameters(module: nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Initialise every parameter from a generator seeded by (seed, name) as if drawn for the FULL
    tensor, keeping this rank's shard: the weights do not depend on t, p, the stage a layer lands
    on or the device. The full tensor is never built: it is drawn in chunks of rows
    (`full_row_chunks`, the same numbers as one draw) and each chunk's part of the shard is
    copied to the parameter, wherever it lives (the device the model was built on)."""
    for name, param in module.named_parameters():
        spec: ParamSpec = param.spec
        if spec.init in ("zeros", "ones"):
            param.fill_(0.0 if spec.init == "zeros" else 1.0)
            continue
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(
            (spec.init_name or name).encode()))
        scale = std / math.sqrt(2.0 * num_layers) if spec.init == "output" else std
        dim = spec.partition_dim
        rows = param.shape[0]  # of the shard along dim 0
        row_offset = spec.tp_rank * rows if dim == 0 else 0
        for lo, chunk in full_row_chunks(spec.full_shape, scale, generator):
            if dim == 0:  # the shard's rows in this chunk
                first, last = max(lo, row_offset), min(lo + chunk.shape[0], row_offset + rows)
                if first < last:
                    param[first - row_offset:last - row_offset].copy_(chunk[first - lo:last - lo])
                continue
            if dim is not None:  # this rank's columns (or further dimension) of every row
                size = param.shape[dim]
                chunk = chunk.narrow(dim, spec.tp_rank * size, size)
            param[lo:lo + chunk.shape[0]].copy_(chunk)


def full_row_chunks(full_shape, std: float, generator: torch.Generator,
                    chunk_elements: int | None = None):
    """(first row, rows) of a normal(0, std) tensor of `full_shape`, drawn chunk after chunk with
    the numbers one `torch.empty(full_shape).normal_(0, std, generator=generator)` gives: the CPU
    kernel draws one uniform per element, in order, and transforms them 16 at a time (redrawing
    the last 16 of a tensor whose size 16 does not divide), so chunks of a multiple of 16
    elements, the last at least 16, reproduce it."""
    full_shape = tuple(full_shape)
    chunk_elements = chunk_elements or INIT_CHUNK_ELEMENTS
    rows = full_shape[0] if full_shape else 1
    per_row = math.prod(full_shape[1:])
    multiple = 16 // math.gcd(per_row, 16)  # rows whose elements 16 divides
    step = max(multiple, chunk_elements // max(per_row, 1) // multiple * multiple)
    bounds = list(range(0, rows, step)) + [rows]
    if len(bounds) > 2 and (bounds[-1] - bounds[-2]) * per_row < 16:
        del bounds[-2]  # a last chunk under 16 elements would take the kernel's other path
    for lo, hi in zip(bounds, bounds[1:]):
        chunk = torch.empty((hi - lo, *full_shape[1:])) if full_shape else torch.empty(())
        yield lo, chunk.normal_(0.0, std, generator=generator)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows: each rank computes its slice of the outputs.
    With `sequence_parallel` the input arrives split along the sequence and is gathered first
    (and again in the backward: only this rank's part is kept)."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 gather_output: bool = False, init: str = "normal", sequence_parallel: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel and group_size(group) > 1
        self.weight = make_param((out_features, in_features), group, 0, init)
        self.bias = make_param((out_features,), group, 0, "zeros") if bias else None

    def forward(self, x):
        if group_size(self.group) == 1:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = _ColumnParallelLinear.apply(x, self.weight, self.bias, self.group,
                                            self.sequence_parallel)
        return gather_from_tensor_parallel(y, self.group) if self.gather_output else y


class _ColumnParallelLinear(torch.autograd.Function):
    """Y = X A^T + b on t > 1 ranks, X whole (its gradient summed over the group: Megatron's f)
    or, with `sequence_parallel`, this rank's part of the sequence, gathered (its gradient
    reduce-scattered). The backward starts that collective on the input's gradient and computes
    A's gradient while it runs (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication).
    Under --sequence-parallel only this rank's part of X is kept, gathered again in the backward
    (Megatron-LM's trade: a second all-gather instead of keeping t times the input)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        ctx.autocast = _autocast_state(x)
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_sequence(x, group) if sequence_parallel else x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.autocast(*ctx.autocast[:2], enabled=ctx.autocast[2]):
            total = all_gather_sequence(x, ctx.group) if ctx.sequence_parallel else x
            grad_input = grad.matmul(weight)
            if ctx.sequence_parallel:
                part, handle = start_reduce_scatter_sequence(grad_input, ctx.group)
            else:
                handle = all_reduce(grad_input, ctx.group, async_op=True)
            # while the input's gradient is summed: the weight's and the bias's
            rows = grad.reshape(-1, grad.shape[-1])
            grad_weight = rows.t().matmul(total.reshape(-1, total.shape[-1]))
            grad_bias = rows.sum(0) if ctx.has_bias else None
            if ctx.sequence_parallel:
                grad_input = finish_reduce_scatter_sequence(part, handle)
            elif handle is not None:
                handle.wait()
        return grad_input, grad_weight, grad_bias, None, None


def _autocast_state(x: torch.Tensor) -> tuple[str, torch.dtype, bool]:
    """The autocast the forward ran under, for the backward to run under it too."""
    device = x.device.type
    return device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns: partial products are summed over the group
    (with `sequence_parallel`, summed and split along the sequence: a reduce-scatter)."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 input_is_parallel: bool = True, init: str = "output",
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel and group_size(group) > 1
        self.weight = make_param((out_features, in_features), group, 1, init)
        self.bias = replicated_param((out_features,), "zeros") if bias else None
        if self.bias is not None:
            self.bias.spec.tensor_partial_grad = self.sequence_parallel

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group)
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sequence_parallel(y, self.group) if self.sequence_parallel \
            else reduce_from_tensor_parallel(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns (with
    `sequence_parallel` each keeps its part of the sequence of the summed lookups)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group, init: str = "normal",
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = make_param((num_embeddings, embedding_dim), group, 0, init)
        rows = self.weight.shape[0]
        self.vocab_start = group_rank(group) * rows
        self.vocab_end = self.vocab_start + rows

    def forward(self, ids):
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, self.group)
        return reduce_from_tensor_parallel(out, self.group)


class ReplicatedLinear(nn.Module):
    """A plain linear layer whose weights every tensor-parallel rank holds in full."""

    def __init__(self, in_features: int, out_features: int, init: str = "normal"):
        super().__init__()
        self.weight = replicated_param((out_features, in_features), init)
        self.bias = replicated_param((out_features,), "zeros")

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


@torch.no_grad()
def sum_tensor_partial_grads(grads: list[torch.Tensor], specs: list[ParamSpec], group) -> None:
    """Sum the gradients of the replicated parameters each rank applies to its part of the work
    only (`ParamSpec.tensor_partial_grad`) over the tensor-parallel group (one all-reduce)."""
    chosen = [g for g, spec in zip(grads, specs) if spec.tensor_partial_grad]
    if not chosen:
        return
    flat = _flatten_dense_tensors(chosen)
    all_reduce(flat, group)
    for grad, summed in zip(chosen, _unflatten_dense_tensors(flat, chosen)):
        grad.copy_(summed)


def parallel_lm_logits(hidden, word_embeddings_weight, group):
    """Vocabulary-parallel logits [.., vocab/t] from the (tied) embedding shard."""
    return F.linear(copy_to_tensor_parallel(hidden, group), word_embeddings_weight)
