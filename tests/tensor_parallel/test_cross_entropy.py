"""Vocabulary-parallel cross entropy equals F.cross_entropy (loss and logits gradient), also when
t does not divide the vocabulary (the padded rows are excluded from the softmax)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tests.distributed_helpers import run_ranks


def _check(rank, world, vocab):
    group = dist.new_group(list(range(world))) if world > 1 else None
    padded = -(-vocab // world) * world
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 6, vocab, generator=generator) * 3
    target = torch.randint(0, vocab, (4, 6), generator=generator)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none").view(4, 6)
    upstream = torch.rand(4, 6, generator=generator)
    (ref * upstream).sum().backward()

    full = torch.cat([logits, torch.full((4, 6, padded - vocab), 7.0)], dim=-1)  # padding rows
    shard = full.chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, group, vocab)
    (loss * upstream).sum().backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(4, 6, padded - vocab)], dim=-1)
    torch.testing.assert_close(shard.grad, ref_grad.chunk(world, dim=-1)[rank], atol=1e-6, rtol=1e-5)
    return True


@pytest.mark.parametrize("world,vocab", [(1, 37), (2, 37), (4, 50), (4, 64)])
def test_vocab_parallel_cross_entropy(world, vocab):
    assert all(run_ranks(world, _check, vocab))
