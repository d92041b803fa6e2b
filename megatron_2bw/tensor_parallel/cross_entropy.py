"""Cross entropy over vocabulary-parallel logits without ever gathering the full logits.

Each rank holds logits for vocabulary rows [start, end). Three all-reduces over the tensor-parallel
group (max, target logit, sum of exponentials) give the exact loss; padded vocabulary rows
(ids >= vocab_size) are excluded from the softmax, so the loss equals F.cross_entropy over the true
vocabulary.

Memory and the host: one fp32 buffer of the logits' size does all the work (Megatron-LM's
in-place recipe): the fp32 logits become the shifted logits, their exponentials, the softmax saved
for the backward and finally the gradient. Which rows are padding follows from the shapes alone,
so nothing waits for the device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.distributed.comm import all_reduce, group_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        rows = logits.shape[-1]
        start = group_rank(group) * rows
        # the one fp32 buffer (a copy: the caller's logits stay as they were)
        work = logits.float() if logits.dtype != torch.float32 else logits.clone()
        if start + rows > vocab_size:  # this rank holds padded rows
            work[..., max(vocab_size - start, 0):].fill_(float("-inf"))
        logits_max = work.max(dim=-1).values
        all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        work.sub_(logits_max.unsqueeze(-1))

        outside = (target < start) | (target >= start + rows)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = work.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        all_reduce(target_logit, group)

        sum_exp = work.exp_().sum(dim=-1)
        all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        softmax = work.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - onehot(target), in the same buffer
        onehot_update = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_update.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits, target, group, vocab_size: int):
    """Per-token loss [...] from vocabulary-parallel logits [..., vocab/t] (computed in fp32)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
