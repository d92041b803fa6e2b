"""Ring attention for context parallelism: each of the cp ranks keeps its queries and passes its
keys and values around the ring, one rank's at a time, merging the partial attentions with their
log-sum-exps; the backward passes the keys and values around again with their gradients.

Rank r holds chunks r and 2cp-1-r of 2cp (models/context_parallel.py). Against the keys of rank
s the causal mask leaves whole blocks: its own chunks causally (step 0), all its queries over
the early chunk of a rank s < r (the late chunk of s comes after both of r's), only its late
queries over both chunks of a rank s > r. The chunks above the diagonal are never computed, and
every step costs every rank the same work. An unmasked block runs scaled-dot-product attention's
flash kernel (the CPU's; CUDA's for fp16/bf16): its aten op returns the log-sum-exp, and its
backward takes the merged output and log-sum-exp. A block with documents
(--reset-attention-mask) or attention dropout, or fp32 on CUDA, runs the same arithmetic
written out in fp32.

The transfers follow NCCL's rules: every rank posts one batch_isend_irecv (send to the next
rank, receive from the previous, keys before values before their gradients), so each pair's
transfers match in posting order; the next step's keys and values travel while this step's
block is computed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_2bw.distributed.comm import group_rank, group_size


def local_positions(seq_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions rank `rank` of `cp` holds: chunks rank and 2 cp - 1 - rank of 2 cp."""
    chunk = seq_length // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


@dataclass(frozen=True)
class RingBlocks:
    """What the ring needs to know of this rank's place: the sequence's chunks and documents."""
    seq_length: int
    cp: int
    rank: int
    document_ids: torch.Tensor | None = None  # [b, s] of the whole sequence

    def positions(self, rank: int, device) -> torch.Tensor:
        return local_positions(self.seq_length, self.cp, rank, device)

    def block(self, source: int) -> tuple[slice, slice, bool]:
        """(query rows, key rows, causal) of this rank's queries over `source`'s keys."""
        half = self.seq_length // (2 * self.cp)
        everything = slice(0, 2 * half)
        if source == self.rank:
            return everything, everything, True
        if source < self.rank:
            return everything, slice(0, half), False
        return slice(half, 2 * half), everything, False

    def mask(self, source: int, rows: slice, cols: slice, device) -> torch.Tensor | None:
        """[b, 1, rows, cols], True where the query may attend the key, with documents only."""
        if self.document_ids is None:
            return None
        queries = self.positions(self.rank, device)[rows]
        keys = self.positions(source, device)[cols]
        causal = keys[None, :] <= queries[:, None]
        same = self.document_ids[:, queries][:, :, None] == self.document_ids[:, keys][:, None, :]
        return (causal & same)[:, None]


def _flash_kernel(q: torch.Tensor, mask, dropout: float) -> str | None:
    """Which flash kernel runs a block: the CPU's ("cpu"), CUDA's for fp16/bf16 ("cuda"), or
    none (the block is written out) with a mask, attention dropout or another device/dtype."""
    if mask is not None or dropout > 0.0:
        return None
    if q.device.type == "cpu":
        return "cpu"
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return "cuda"
    return None


def _block_forward(q, k, v, causal, mask, dropout, scale):
    """(out, lse, dropout mask) of q over one block of keys (lse fp32, -inf where a query sees
    no key)."""
    kernel = _flash_kernel(q, mask, dropout)
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse, None
    if kernel == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale)[:2]
        return out.float(), lse, None
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal and mask is None:  # a block's own mask (documents) holds the causal one
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    keep = None
    if dropout > 0.0:
        keep = torch.rand_like(probs) >= dropout
        probs = probs * keep / (1.0 - dropout)
    return torch.matmul(probs, v.float()), lse, keep


def _block_backward(grad_out, q, k, v, out, lse, causal, mask, keep, dropout, scale):
    """(dq, dk, dv) of one block, in fp32, given the merged output and log-sum-exp."""
    kernel = _flash_kernel(q, mask, dropout)
    if kernel == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
        return tuple(g.float() for g in grads)
    if kernel == "cuda":  # no dropout: no sequence lengths of packed batches, no RNG state
        none = torch.empty(0, device=q.device)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.contiguous(), lse.contiguous(), none, none, q.shape[2], k.shape[2], 0.0, causal,
            none, none, scale=scale)
        return tuple(g.float() for g in grads)
    q32, k32, v32, dout = q.float(), k.float(), v.float(), grad_out.float()
    scores = torch.matmul(q32, k32.transpose(-1, -2)) * scale
    if causal and mask is None:  # a block's own mask (documents) holds the causal one
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    dropped = probs if keep is None else probs * keep / (1.0 - dropout)
    dv = torch.matmul(dropped.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v32.transpose(-1, -2))
    if keep is not None:
        dprobs = dprobs * keep / (1.0 - dropout)
    rowsum = (dout * out.float()).sum(-1, keepdim=True)
    dscores = probs * (dprobs - rowsum) * scale
    return torch.matmul(dscores, k32), torch.matmul(dscores.transpose(-1, -2), q32), dv


def _exchange(tensors: list[torch.Tensor], group) -> tuple[list[torch.Tensor], list]:
    """Send `tensors` to the next rank of the ring and receive as many from the previous one:
    one batch on every rank (sends, then receives, each in the same order)."""
    cp, rank = group_size(group), group_rank(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % cp)
    previous = dist.get_global_rank(group, (rank - 1) % cp)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, next_rank, group) for t in tensors] + \
        [dist.P2POp(dist.irecv, t, previous, group) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, blocks: RingBlocks, dropout: float):
        scale = 1.0 / math.sqrt(q.shape[-1])
        cp, rank = blocks.cp, blocks.rank
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        keeps = []
        current = [k, v]
        for step in range(cp):
            source = (rank - step) % cp
            requests = None
            if step < cp - 1:  # the next step's keys and values travel meanwhile
                incoming, requests = _exchange([t.contiguous() for t in current], group)
            rows, cols, causal = blocks.block(source)
            mask = blocks.mask(source, rows, cols, q.device)
            block_out, block_lse, keep = _block_forward(
                q[:, :, rows], current[0][:, :, cols], current[1][:, :, cols], causal, mask,
                dropout, scale)
            keeps.append(keep)
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            # a query that has seen no key yet has -inf - -inf: its old output weighs nothing
            old = torch.exp(lse[:, :, rows] - merged).nan_to_num_(0.0).unsqueeze(-1)
            new = torch.exp(block_lse - merged).nan_to_num_(0.0).unsqueeze(-1)
            out[:, :, rows] = out[:, :, rows] * old + block_out.nan_to_num(0.0) * new
            lse[:, :, rows] = merged
            if requests is not None:
                _wait(requests)
                current = incoming
        out = out.to(q.dtype)
        ctx.group, ctx.blocks, ctx.dropout, ctx.scale, ctx.keeps = group, blocks, dropout, scale, \
            keeps
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        blocks, group = ctx.blocks, ctx.group
        cp, rank = blocks.cp, blocks.rank
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        current = [k, v, torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                   torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(cp):
            source = (rank - step) % cp
            rows, cols, causal = blocks.block(source)
            mask = blocks.mask(source, rows, cols, q.device)
            block_k, block_v = current[0][:, :, cols], current[1][:, :, cols]
            dq_block, dk_block, dv_block = _block_backward(
                grad_out[:, :, rows], q[:, :, rows], block_k, block_v, out[:, :, rows],
                lse[:, :, rows], causal, mask, ctx.keeps[step], ctx.dropout, ctx.scale)
            dq[:, :, rows] += dq_block
            current[2][:, :, cols] += dk_block
            current[3][:, :, cols] += dv_block
            # the keys and values go on with their gradients; after the last step only the
            # gradients, which reach their owner (the next rank)
            sent = current if step < cp - 1 else current[2:]
            received, requests = _exchange([t.contiguous() for t in sent], group)
            _wait(requests)
            current = received if step < cp - 1 else current[:2] + received
        return dq.to(q.dtype), current[2].to(k.dtype), current[3].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, blocks: RingBlocks, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's queries [b, heads, 2s/2cp, d] over the whole sequence's
    keys and values, passed around the ring (k and v as many heads as q)."""
    return _RingAttention.apply(q, k, v, group, blocks, dropout)
