"""Ring attention against one process's causal scaled_dot_product_attention, forward and
backward, at cp = 2 and 4: the flash kernel's blocks, the written-out blocks of documents
(--reset-attention-mask) and of bf16, and that every rank computes only the blocks on or below
the diagonal, as many scores as any other rank."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_2bw.models import ring_attention
from megatron_2bw.models.ring_attention import RingBlocks, local_positions, ring_attention as ring
from tests.distributed_helpers import run_ranks

B, HEADS, SEQ, D = 2, 3, 16, 8


def _reference(documents, dtype):
    generator = torch.Generator().manual_seed(0)
    q, k, v, upstream = (torch.randn(B, HEADS, SEQ, D, generator=generator).to(dtype)
                         for _ in range(4))
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if documents is not None:
        mask = (mask & (documents[:, :, None] == documents[:, None, :]))[:, None]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*(t.float() for t in leaves), attn_mask=mask)
    (out * upstream.float()).sum().backward()
    return (q, k, v, upstream), out, [t.grad for t in leaves]


def _ring_rank(rank, world, with_documents, dtype):
    group = dist.new_group(list(range(world)))
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 11 + [1] * 5]) \
        if with_documents else None
    (q, k, v, upstream), reference, reference_grads = _reference(documents, dtype)
    mine = local_positions(SEQ, world, rank)
    leaves = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = ring(*leaves, group, RingBlocks(SEQ, world, rank, documents))
    (out.float() * upstream[:, :, mine].float()).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference[:, :, mine], atol=tolerance, rtol=tolerance)
    for got, want in zip(leaves, reference_grads):
        torch.testing.assert_close(got.grad.float(), want[:, :, mine].float(), atol=tolerance * 4,
                                   rtol=tolerance)
    return True


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("with_documents", [False, True], ids=["causal", "documents"])
def test_ring_attention_matches_one_process(cp, with_documents):
    assert all(run_ranks(cp, _ring_rank, with_documents, torch.float32))


def test_ring_attention_in_bf16():
    assert all(run_ranks(2, _ring_rank, False, torch.bfloat16))


def test_blocks_skip_the_chunks_above_the_diagonal_and_balance_the_work():
    """Each rank's blocks cover exactly the (query, key) pairs with key <= query, and every rank
    computes as many scores as any other (2cp chunks in zigzag order)."""
    for cp in (2, 4):
        work = []
        for rank in range(cp):
            blocks = RingBlocks(SEQ, cp, rank)
            queries = local_positions(SEQ, cp, rank)
            covered, scores = set(), 0
            for source in range(cp):
                rows, cols, causal = blocks.block(source)
                keys = local_positions(SEQ, cp, source)
                for i in range(len(queries))[rows]:
                    for j in range(len(keys))[cols]:
                        if not causal or j <= i:
                            covered.add((int(queries[i]), int(keys[j])))
                scores += len(range(len(queries))[rows]) * len(range(len(keys))[cols])
            assert covered == {(int(q), k) for q in queries for k in range(int(q) + 1)}
            work.append(scores)
        assert work == [work[0]] * cp


def test_unmasked_blocks_run_the_flash_kernel(monkeypatch):
    calls = []
    original = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    monkeypatch.setattr(ring_attention.torch.ops.aten,
                        "_scaled_dot_product_flash_attention_for_cpu",
                        lambda *a, **k: calls.append(1) or original(*a, **k), raising=False)
    q = torch.randn(1, 2, 8, 4)
    ring_attention._block_forward(q, q, q, True, None, 0.0, 0.5)
    assert calls


def test_a_written_out_block_with_attention_dropout_has_the_gradient_of_its_masks():
    """Attention dropout (the written-out block): forward and backward against autograd through
    the same kept probabilities."""
    torch.manual_seed(0)
    q, k, v, upstream = (torch.randn(B, HEADS, 8, D) for _ in range(4))
    scale, p = D ** -0.5, 0.25
    out, lse, keep = ring_attention._block_forward(q, k, v, True, None, p, scale)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = (leaves[0] @ leaves[1].transpose(-1, -2) * scale).masked_fill(
        ~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    reference = (scores.softmax(-1) * keep / (1 - p)) @ leaves[2]
    (reference * upstream).sum().backward()
    torch.testing.assert_close(out, reference.detach())
    grads = ring_attention._block_backward(upstream, q, k, v, out, lse, True, None, keep, p, scale)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad)
