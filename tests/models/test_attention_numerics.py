"""--attention-softmax-in-fp32 and --apply-query-key-layer-scaling (Megatron-LM's unfused attention
for fp16/bf16): the same function as torch's scaled_dot_product_attention, with the softmax in fp32,
and layer scaling keeps fp16 scores of deep layers from overflowing."""
import pytest
import torch
import torch.nn.functional as F

from megatron_2bw.config import ModelConfig
from megatron_2bw.models import build_stage_model
from megatron_2bw.models.transformer import softmax_in_fp32_attention

B, HEADS, S, D = 2, 3, 8, 16


def qkv(scale: float = 1.0):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(B, HEADS, S, D, generator=generator) * scale for _ in range(3)]


def document_mask() -> torch.Tensor:
    """Causal within two documents of 3 and 5 tokens (--reset-attention-mask's shape)."""
    documents = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    same = documents[:, None] == documents[None, :]
    return (same & torch.ones(S, S, dtype=torch.bool).tril())[None, None]


@pytest.mark.parametrize("mask, causal", [
    (None, True),
    (None, False),
    (document_mask(), False),
    (torch.tensor([[1] * 6 + [0] * 2, [1] * 8]).bool()[:, None, None, :], False),  # padding
])
def test_fp32_softmax_path_is_scaled_dot_product_attention(mask, causal):
    q, k, v = qkv()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    for coefficient in (1, 7):  # layer scaling divides and multiplies back: the same function
        ours = softmax_in_fp32_attention(q, k, v, mask, causal, 0.0, coefficient)
        assert torch.allclose(ours, expected, atol=1e-6), (ours - expected).abs().max()


def test_layer_scaling_keeps_fp16_scores_of_deep_layers_finite():
    """Scores of 70000 overflow fp16 (max 65504); divided by layer 24 they fit, and are multiplied
    back in fp32. Each query matches only its own key, so attention returns v exactly."""
    directions = torch.eye(D)[:S] * (4 * 70000) ** 0.5  # q.k / sqrt(D) = 70000 on the diagonal
    q = k = directions.expand(B, HEADS, S, D).half()
    v = torch.randn(B, HEADS, S, D).half()
    unscaled = softmax_in_fp32_attention(q, k, v, None, True, 0.0, coefficient=1)
    assert not torch.isfinite(unscaled).all()
    scaled = softmax_in_fp32_attention(q, k, v, None, True, 0.0, coefficient=24)
    assert scaled.dtype == torch.float16 and torch.equal(scaled, v)


def gpt(**overrides):
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=S,
                         vocab_size=50, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                         attention_dropout=0.0, **overrides)
    return build_stage_model(config, None, 1, range(2), True, True, 1234)


@pytest.mark.parametrize("flag", ["attention_softmax_in_fp32", "apply_query_key_layer_scaling"])
@pytest.mark.parametrize("groups", [None, 2])
def test_bf16_model_keeps_fused_attention_whose_softmax_is_fp32(flag, groups, monkeypatch):
    """By default scaled_dot_product_attention computes the softmax in fp32 already: the flags
    keep it; with grouped-query attention k and v go one per group through enable_gqa (the CUDA
    path, taken here on the CPU) and give the model's result."""
    import megatron_2bw.models.transformer as transformer
    tokens = torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(1))
    reference = gpt(num_query_groups=groups).logits(tokens)  # k and v repeated (CPU)
    monkeypatch.setattr(transformer, "shares_groups_in_sdpa", lambda q, mask: mask is None)
    model = gpt(num_query_groups=groups, **{flag: True}).to(torch.bfloat16)
    monkeypatch.setattr(transformer, "softmax_in_fp32_attention",
                        lambda *args: pytest.fail("unfused path"))
    fused = F.scaled_dot_product_attention
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((q.shape[1], k.shape[1], kw))
                        or fused(q, k, v, **kw))
    logits = model.logits(tokens)
    assert [(q_heads, kv_heads, kw["enable_gqa"]) for q_heads, kv_heads, kw in calls] == \
        [(4, groups or 4, groups is not None)] * 2
    assert torch.allclose(logits.float(), reference, atol=0.1)  # bf16 of the fp32 model
    shared = gpt(num_query_groups=groups)  # fp32: the same function as the repeated k and v
    torch.testing.assert_close(shared.logits(tokens), reference, atol=1e-5, rtol=1e-5)
    logits.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("flag", ["attention_softmax_in_fp32", "apply_query_key_layer_scaling"])
def test_bf16_model_takes_the_fp32_softmax_path(flag, monkeypatch,
                                                reduced_precision_math_attention):
    tokens = torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(1))
    reference = gpt().logits(tokens)
    model = gpt(**{flag: True}).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(args) or pytest.fail("fused path"))
    import megatron_2bw.models.transformer as transformer
    original = transformer.softmax_in_fp32_attention
    monkeypatch.setattr(transformer, "softmax_in_fp32_attention",
                        lambda *args: calls.append(args) or original(*args))
    logits = model.logits(tokens)
    assert len(calls) == 2 and all(args[4] and args[5] == 0.0 for args in calls)  # causal, eval
    assert [args[6] for args in calls] == \
        ([1, 2] if flag == "apply_query_key_layer_scaling" else [1, 1])  # the layers' numbers
    assert torch.allclose(logits.float(), reference, atol=0.1)  # bf16 of the fp32 model
    logits.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_layer_without_dropout_traces_as_one_graph():
    """--torch-compile: without dropout the attention core forks no RNG state (reading one on the
    host breaks the graph), so a compiled layer is one graph, not four."""
    import torch._dynamo
    from megatron_2bw.models.transformer import TransformerLayer
    from megatron_2bw.tensor_parallel.random import seed_everything
    seed_everything(1, 0, 0)  # the tracker holds its state, as in training
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=S,
                         vocab_size=200, hidden_dropout=0.0, attention_dropout=0.0)
    layer = TransformerLayer(config, None, causal=True)
    try:
        explained = torch._dynamo.explain(layer)(torch.randn(B, S, 64))
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, [b.reason[:120] for b in explained.break_reasons]
