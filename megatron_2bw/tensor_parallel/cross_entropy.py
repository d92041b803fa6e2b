"""Cross entropy over vocabulary-parallel logits without ever gathering the full logits.

Each rank holds logits for vocabulary rows [start, end). Three all-reduces over the tensor-parallel
group (max, target logit, sum of exponentials) give the exact loss; padded vocabulary rows
(ids >= vocab_size) are excluded from the softmax, so the loss equals F.cross_entropy over the true
vocabulary.

Memory: no fp32 copy of the whole logits. The sum of exponentials and, in the backward, the
softmax are computed in fp32 over chunks of tokens (`CHUNK_ELEMENTS` logits at a time); the
backward keeps the logits themselves (in their own dtype) and each token's max and sum, and
writes the gradient chunk by chunk into one tensor of the logits' dtype. The arithmetic is the
one-buffer form's, element by element. Which rows are padding follows from the shapes alone, so
nothing waits for the device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.distributed.comm import all_reduce, group_rank

CHUNK_ELEMENTS = 1 << 24  # fp32 logits per chunk: 64 MiB of transient


def _chunks(tokens: int, vocab_rows: int):
    step = max(1, CHUNK_ELEMENTS // max(vocab_rows, 1))
    return ((lo, min(lo + step, tokens)) for lo in range(0, tokens, step))


def _exp_shifted(logits: torch.Tensor, logits_max: torch.Tensor) -> torch.Tensor:
    """exp(logits - max) in fp32 for a chunk of tokens (a new chunk-sized tensor)."""
    return logits.to(torch.float32, copy=True).sub_(logits_max.unsqueeze(-1)).exp_()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        rows = logits.shape[-1]
        start = group_rank(group) * rows
        real = min(max(vocab_size - start, 0), rows)  # this rank's rows below the padding
        flat, flat_target = logits.reshape(-1, rows), target.reshape(-1)
        tokens = flat.shape[0]
        if real:
            logits_max = flat[:, :real].max(dim=-1).values.float()
        else:
            logits_max = flat.new_full((tokens,), float("-inf"), dtype=torch.float32)
        all_reduce(logits_max, group, op=dist.ReduceOp.MAX)

        outside = (flat_target < start) | (flat_target >= start + real)
        local_target = (flat_target - start).masked_fill(outside, 0)
        target_logit = flat.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() - logits_max
        target_logit = target_logit.masked_fill(outside, 0.0)
        all_reduce(target_logit, group)

        sum_exp = torch.zeros_like(logits_max)
        for lo, hi in _chunks(tokens, real):
            sum_exp[lo:hi] = _exp_shifted(flat[lo:hi, :real], logits_max[lo:hi]).sum(dim=-1)
        all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        ctx.real = real
        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, outside)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, logits_max, sum_exp, local_target, outside = ctx.saved_tensors
        rows, real = logits.shape[-1], ctx.real
        flat = logits.reshape(-1, rows)
        grad = torch.empty_like(flat)
        grad[:, real:].zero_()  # padded rows: no gradient
        grad_loss = grad_loss.reshape(-1)
        inside = (~outside).float()
        # d loss / d logits = (softmax - onehot(target)) * grad_loss, a chunk of tokens at a time
        # (none on a rank whose rows are all padding)
        for lo, hi in _chunks(flat.shape[0], real) if real else ():
            softmax = _exp_shifted(flat[lo:hi, :real], logits_max[lo:hi])
            softmax.div_(sum_exp[lo:hi].unsqueeze(-1))
            softmax.scatter_add_(-1, local_target[lo:hi].unsqueeze(-1),
                                 -inside[lo:hi].unsqueeze(-1))
            grad[lo:hi, :real] = softmax.mul_(grad_loss[lo:hi].unsqueeze(-1))
        return grad.view_as(logits), None, None, None


def vocab_parallel_cross_entropy(logits, target, group, vocab_size: int):
    """Per-token loss [...] from vocabulary-parallel logits [..., vocab/t] (computed in fp32)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
