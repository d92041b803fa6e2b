"""Vocabulary-parallel cross entropy equals F.cross_entropy (loss and logits gradient), also when
t does not divide the vocabulary (the padded rows are excluded from the softmax), and computes it
in chunks of tokens without an fp32 copy of the whole logits."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_2bw.tensor_parallel import cross_entropy
from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tests.distributed_helpers import run_ranks


def _check(rank, world, vocab, padded=None):
    cross_entropy.CHUNK_ELEMENTS = 5 * 16  # 5 tokens a chunk: 24 tokens in 5 chunks
    group = dist.new_group(list(range(world))) if world > 1 else None
    padded = padded or -(-vocab // world) * world
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


@pytest.mark.parametrize("world,vocab,padded", [(1, 37, None), (2, 37, None), (4, 50, None),
                                                (4, 64, None), (2, 20, 64)])
def test_vocab_parallel_cross_entropy(world, vocab, padded):
    """(2, 20, 64): rank 1's rows are all padding."""
    assert all(run_ranks(world, _check, vocab, padded))


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
def test_no_fp32_logits_sized_buffer_and_the_loss_to_1e6(dtype, padded, monkeypatch):
    """The loss of the logits costs no fp32 copy of them in the forward or the backward (chunks
    of 5 tokens of 24 here; the gradient of fp32 logits is fp32), and equals F.cross_entropy of
    the fp32 logits to 1e-6."""
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", 5 * 64)
    vocab = 60 if padded else 64
    logits = (3 * torch.randn(4, 6, 64)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (4, 6))
    counter = _LogitsSizedAllocations(logits.numel())
    with counter:
        loss = vocab_parallel_cross_entropy(logits, target, None, vocab)
    assert counter.count == 0
    with counter:
        loss.sum().backward()
    assert counter.count == (dtype == torch.float32)  # the gradient itself, in fp32 logits
    reference_logits = logits.detach().float()[..., :vocab].requires_grad_()
    reference = F.cross_entropy(reference_logits.reshape(-1, vocab), target.view(-1),
                                reduction="none").view(4, 6)
    reference.sum().backward()
    torch.testing.assert_close(loss, reference, atol=1e-6, rtol=1e-6)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad[..., :vocab], reference_logits.grad.to(dtype))
    assert not logits.grad[..., vocab:].any()
