"""Context parallelism (--context-parallel-size cp): the cp ranks of a replica split every
sequence, and each layer's attention gathers the keys and values of all of it.

The sequence is cut into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r, so that under
the causal mask every rank has as much attention work as any other (Megatron-LM's load
balancing). Keys and values are all-gathered in rank order (the backward reduce-scatters their
gradients), and the mask places every query and key at its position in the whole sequence, so no
reordering is needed. (Megatron-LM passes keys and values around a ring instead, overlapping the
transfers with the attention; the all-gather is the simpler exchange Llama 3 was trained with.)

Each rank's loss is its targets' share of the sequence's mean, times cp: averaged over the
data-parallel group, which holds the cp ranks too, the gradients are those of the whole
sequence's mean."""
from __future__ import annotations

import functools

import torch

from megatron_2bw.distributed.comm import group_rank, group_size
from megatron_2bw.tensor_parallel.mappings import gather_from_sequence_parallel


def local_positions(seq_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions rank `rank` of `cp` holds: chunks rank and 2 cp - 1 - rank of 2 cp."""
    chunk = seq_length // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


class ContextSplit:
    """This rank's part of a microbatch of sequences of `seq_length`."""

    def __init__(self, seq_length: int, group, device):
        cp, rank = group_size(group), group_rank(group)
        if seq_length % (2 * cp):
            raise ValueError(f"--seq-length {seq_length} must divide into 2 x "
                             f"--context-parallel-size {cp} chunks")
        self.cp = cp
        self.queries = local_positions(seq_length, cp, rank, device)
        # the keys after the all-gather: every rank's positions, in rank order
        self.keys = torch.cat([local_positions(seq_length, cp, r, device) for r in range(cp)])

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of [b, s, ...]."""
        return x[:, self.queries]

    def attention_mask(self, document_ids: torch.Tensor | None) -> torch.Tensor:
        """[b or 1, 1, local queries, all keys], True where the query may attend the key: the key
        is not after it (and, with --reset-attention-mask, in its document)."""
        mask = (self.keys[None, :] <= self.queries[:, None])[None, None]
        if document_ids is not None:
            same = self.local(document_ids)[:, :, None] == document_ids[:, self.keys][:, None, :]
            mask = mask & same[:, None]
        return mask

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


def gather_keys(x: torch.Tensor, group) -> torch.Tensor:
    """[b, heads, local s, d] -> [b, heads, s, d] in rank order; the backward sums every rank's
    gradient of this rank's keys (a reduce-scatter)."""
    return gather_from_sequence_parallel(x.transpose(1, 2), group).transpose(1, 2)
