"""Context parallelism (--context-parallel-size cp): the cp ranks of a replica split every
sequence, and each layer's attention passes the keys and values around the ring of them
(models/ring_attention.py).

The sequence is cut into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r, so that under
the causal mask every rank has as much attention work as any other (Megatron-LM's load
balancing): at every step of the ring each rank computes one block of half its queries' width.

Each rank's loss is its targets' share of the sequence's mean, times cp: averaged over the
data-parallel group, which holds the cp ranks too, the gradients are those of the whole
sequence's mean."""
from __future__ import annotations

import functools

import torch

from megatron_2bw.distributed.comm import group_rank, group_size
from megatron_2bw.models.ring_attention import RingBlocks, local_positions


class ContextSplit:
    """This rank's part of a microbatch of sequences of `seq_length`."""

    def __init__(self, seq_length: int, group, device):
        cp, rank = group_size(group), group_rank(group)
        if seq_length % (2 * cp):
            raise ValueError(f"--seq-length {seq_length} must divide into 2 x "
                             f"--context-parallel-size {cp} chunks")
        self.cp, self.rank, self.seq_length = cp, rank, seq_length
        self.queries = local_positions(seq_length, cp, rank, device)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of [b, s, ...]."""
        return x[:, self.queries]

    def ring(self, document_ids: torch.Tensor | None) -> RingBlocks:
        """The attention's view of the split (and, with --reset-attention-mask, the documents)."""
        return RingBlocks(self.seq_length, self.cp, self.rank, document_ids)

    def loss(self, losses: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
        """cp x this rank's share of the sequence's mean loss (losses [b, local s]; loss_mask
        [b, s], the whole sequence's)."""
        if loss_mask is None:
            return losses.mean()  # every rank holds s / cp of the targets
        loss_mask = loss_mask.to(losses.dtype)
        local = (losses * self.local(loss_mask)).sum()
        return self.cp * local / loss_mask.sum().clamp(min=1.0)


@functools.lru_cache(maxsize=8)
def context_split(seq_length: int, group, device) -> ContextSplit:
    """The split of `seq_length` for this rank of `group`, built once (the forward of every
    microbatch asks for it)."""
    return ContextSplit(seq_length, group, device)

