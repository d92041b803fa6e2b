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


class _LogitsSizedAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the fp32 tensors of `numel` elements that ops create in new storage (in-place ops
    and views reuse their input's)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(
            (args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32
                    and t.numel() == self.numel and t.untyped_storage().data_ptr() not in inputs):
                self.count += 1
        return out


@pytest.mark.parametrize("dtype, padded", [(torch.bfloat16, True), (torch.float32, False)])
def test_one_fp32_logits_sized_buffer_in_forward_and_none_in_backward(dtype, padded):
    """The loss of bf16 logits costs one fp32 copy of them (which becomes the gradient), not a
    second one for the shifted logits or the padding mask."""
    vocab = 60 if padded else 64
    logits = torch.randn(4, 6, 64).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (4, 6))
    counter = _LogitsSizedAllocations(logits.numel())
    with counter:
        loss = vocab_parallel_cross_entropy(logits, target, None, vocab)
    assert counter.count == 1
    counter.count = 0
    with counter:
        loss.sum().backward()
    assert counter.count == 0
    reference = F.cross_entropy(logits.detach().float()[..., :vocab].reshape(-1, vocab),
                                target.view(-1), reduction="none").view(4, 6)
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
