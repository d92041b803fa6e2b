"""GPT with Llama's switches (RMSNorm, no biases, SwiGLU, rotary positions, grouped-query attention,
untied head) against independent references:
- transformers' LlamaForCausalLM, given the same weights through a mapping written here, computes
  the same logits; with --qk-layernorm (and the gains stored as gain - 1, --apply-layernorm-1p)
  transformers' Qwen3ForCausalLM does;
- the rotary embeddings rotate each channel pair as a complex multiplication by e^(i * pos * theta);
- Megatron-LM's default --ffn-hidden-size under --swiglu.
Tensor and pipeline parallelism with these switches: tests/pipeline/test_pipeline_equivalence.py."""
import math

import pytest
import torch
import transformers

from megatron_2bw.config import ModelConfig
from megatron_2bw.models import build_stage_model
from megatron_2bw.models.transformer import RotaryEmbedding, apply_rotary

HEADS, GROUPS, HIDDEN, FFN, VOCAB = 8, 2, 64, 96, 101


def llama_like(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                  num_query_groups=GROUPS, ffn_hidden_size=FFN, seq_length=16, vocab_size=VOCAB,
                  make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
                  normalization="RMSNorm", add_bias_linear=False, swiglu=True,
                  position_embedding_type="rope", rotary_base=500000.0, layernorm_epsilon=1e-6,
                  untie_embeddings_and_output_weights=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_state_dict(model, config: ModelConfig) -> dict:
    """Our parameters under transformers' Llama (and Qwen3) names: qkv rows (group, its query heads
    then k then v, head_dim); fc1 rows alternate gate and up; gains stored as gain - 1 under
    --apply-layernorm-1p."""
    offset = 1.0 if config.apply_layernorm_1p else 0.0
    ours = {name: p.detach() + offset if name.endswith("norm.weight") else p.detach()
            for name, p in model.named_parameters()}
    d, per_group = config.head_dim, HEADS // GROUPS
    hf = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"][:VOCAB],
          "lm_head.weight": ours["output_layer"][:VOCAB],
          "model.norm.weight": ours["final_norm.weight"]}
    for i in range(config.num_layers):
        layer, theirs = f"transformer.layers.{i}.", f"model.layers.{i}."
        qkv = ours[layer + "attention.qkv.weight"].view(GROUPS, per_group + 2, d, HIDDEN)
        gate_up = ours[layer + "mlp.fc1.weight"].view(FFN, 2, HIDDEN)
        hf.update({
            theirs + "self_attn.q_proj.weight": qkv[:, :per_group].reshape(-1, HIDDEN),
            theirs + "self_attn.k_proj.weight": qkv[:, per_group].reshape(-1, HIDDEN),
            theirs + "self_attn.v_proj.weight": qkv[:, per_group + 1].reshape(-1, HIDDEN),
            theirs + "self_attn.o_proj.weight": ours[layer + "attention.dense.weight"],
            theirs + "mlp.gate_proj.weight": gate_up[:, 0],
            theirs + "mlp.up_proj.weight": gate_up[:, 1],
            theirs + "mlp.down_proj.weight": ours[layer + "mlp.fc2.weight"],
            theirs + "input_layernorm.weight": ours[layer + "input_norm.weight"],
            theirs + "post_attention_layernorm.weight": ours[layer + "post_attention_norm.weight"]})
        if config.qk_layernorm:
            hf[theirs + "self_attn.q_norm.weight"] = ours[layer + "attention.q_norm.weight"]
            hf[theirs + "self_attn.k_norm.weight"] = ours[layer + "attention.k_norm.weight"]
    return hf


def randomize_norms(model) -> None:
    """Norms start at gain 1 (stored 0 under --apply-layernorm-1p): random gains make a test see
    them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5) if p.spec.init == "zeros" else p.uniform_(0.5, 1.5)


def same_logits(model, reference) -> torch.Tensor:
    """Our logits, after checking transformers' `reference` computes them too."""
    tokens = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.logits(tokens), reference(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    return theirs


def test_llama_switches_compute_transformers_llama():
    config = llama_like()
    model = build_stage_model(config, None, 1, range(config.num_layers), True, True, 1234)
    randomize_norms(model)
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=16,
        rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False)
    reference = transformers.LlamaForCausalLM(hf_config).eval()
    missing, unexpected = reference.load_state_dict(hf_state_dict(model, config), strict=False)
    assert not unexpected and all("rotary" in name for name in missing)
    theirs = same_logits(model, reference)
    # and the comparison can fail: GPT-2's layout on the same weights computes something else
    plain = build_stage_model(llama_like(normalization="LayerNorm"), None, 1, range(2), True, True,
                              1234)
    tokens = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (plain.logits(tokens) - theirs).abs().max() > 1e-2


def test_qk_layernorm_and_zero_centred_gains_compute_transformers_qwen3():
    """--qk-layernorm normalises each head's queries and keys before the rotary embeddings, as
    Qwen3 does; --apply-layernorm-1p stores every gain (q/k norms included) as gain - 1."""
    config = llama_like(qk_layernorm=True, apply_layernorm_1p=True)
    model = build_stage_model(config, None, 1, range(config.num_layers), True, True, 1234)
    attention = model.transformer.layers["0"].attention
    assert attention.q_norm.weight.shape == (config.head_dim,)
    assert not attention.q_norm.weight.any()  # zero-centred: the gain 1 is stored as 0
    randomize_norms(model)
    hf_config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=config.head_dim,
        max_position_embeddings=16, rms_norm_eps=1e-6, rope_theta=500000.0,
        tie_word_embeddings=False, attention_bias=False)
    reference = transformers.Qwen3ForCausalLM(hf_config).eval()
    missing, unexpected = reference.load_state_dict(hf_state_dict(model, config), strict=False)
    assert not unexpected and all("rotary" in name for name in missing)
    same_logits(model, reference)


def complex_rotation(x: torch.Tensor, positions: torch.Tensor, rotated: int, base: float,
                     interleaved: bool) -> torch.Tensor:
    """Pair channel j with its partner (j + rotated/2, or j + 1 when interleaved), read the pair as
    a + ib and multiply by exp(i * position * base^(-2k/rotated)) for the pair's index k."""
    out = x.clone()
    pairs = [(2 * k, 2 * k + 1) if interleaved else (k, k + rotated // 2)
             for k in range(rotated // 2)]
    for k, (a, b) in enumerate(pairs):
        angle = positions[:, None, :].double() * base ** (-2 * k / rotated)
        value = torch.complex(x[..., a].double(), x[..., b].double()) * torch.polar(
            torch.ones_like(angle), angle)
        out[..., a], out[..., b] = value.real.float(), value.imag.float()
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotary_embeddings_rotate_channel_pairs(interleaved, percent):
    config = llama_like(rotary_percent=percent, rotary_interleaved=interleaved, rotary_base=100.0)
    x = torch.randn(2, 3, 5, config.head_dim)  # [b, heads, s, head_dim]
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]])  # the second one reset
    tables = RotaryEmbedding(config)(5, positions)
    rotated = int(config.head_dim * percent)
    expected = complex_rotation(x, positions, rotated, 100.0, interleaved)
    assert torch.allclose(apply_rotary(x, tables, interleaved), expected, atol=1e-5)
    assert torch.equal(apply_rotary(x, tables, interleaved)[..., rotated:], x[..., rotated:])
    # default positions are 0..s-1
    default = apply_rotary(x, RotaryEmbedding(config)(5), interleaved)
    assert torch.allclose(default[0], expected[0], atol=1e-5)


def test_swiglu_default_ffn_follows_megatron():
    """int(4h * 2/3 / 64) * 64: 10880 for h = 4096 (Llama-2 7B passes 11008 explicitly)."""
    assert ModelConfig(hidden_size=4096, num_attention_heads=32, swiglu=True).ffn_hidden_size \
        == 10880
    assert ModelConfig(hidden_size=4096, num_attention_heads=32).ffn_hidden_size == 4 * 4096
    assert math.isclose(10880 / (4 * 4096), 2 / 3, rel_tol=0.01)


def test_grouped_queries_shrink_the_kv_projection():
    config = llama_like()
    model = build_stage_model(config, None, 1, range(1), True, True, 1234)
    qkv = model.transformer.layers["0"].attention.qkv.weight
    assert qkv.shape == ((HEADS + 2 * GROUPS) * config.head_dim, HIDDEN)
    names = {name for name, _ in model.named_parameters()}
    assert not any(name.endswith("bias") for name in names)
    assert "embedding.position_embeddings" not in names


def test_rope_scaling_gives_llama31_frequencies():
    """--use-rope-scaling: transformers' llama3 rope type computes the same inverse frequencies,
    here with one kept, one blended and one divided by the factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = llama_like(rope_scaling=True, rope_scaling_factor=8.0, seq_length=8192)
    hf_config = transformers.LlamaConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, max_position_embeddings=8192 * 8,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                         "rope_theta": 500000.0})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = RotaryEmbedding(config).inverse_frequencies("cpu")
    assert torch.allclose(ours, theirs.float(), rtol=1e-6)
    plain = RotaryEmbedding(llama_like()).inverse_frequencies("cpu")
    ratios = (plain / ours).tolist()
    assert ratios[0] == pytest.approx(1.0) and ratios[-1] == pytest.approx(8.0)
    assert any(1.01 < r < 7.99 for r in ratios)
