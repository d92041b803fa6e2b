"""The CUDA path of every layer against its CPU result, in fp32: forward and every gradient."""
import pytest
import torch

from megatron_2bw.config import ModelConfig
from megatron_2bw.models import build_stage_model
from megatron_2bw.models.transformer import (LayerNorm, ParallelAttention, ParallelMLP, RMSNorm,
                                             TransformerLayer)
from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_2bw.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                 VocabParallelEmbedding)

H, S, B = 64, 32, 2
GPT2 = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=S,
                   vocab_size=200, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                   attention_dropout=0.0)
LLAMA = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, num_query_groups=2,
                    seq_length=S, vocab_size=200,
                    make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
                    normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                    untie_embeddings_and_output_weights=True, add_bias_linear=False,
                    ffn_hidden_size=128)


def _randomised(module: torch.nn.Module) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return module


def _compare(module, inputs, device, atol=1e-4):
    """module(*inputs) and the gradients of a fixed projection of its output, CPU vs device."""
    outputs, grads = [], []
    for where in (torch.device("cpu"), device):
        m = module.to(where)
        m.zero_grad(set_to_none=True)
        args = [x.to(where).requires_grad_() if x.is_floating_point() else x.to(where)
                for x in inputs]
        out = m(*args)
        out = out[0] if isinstance(out, tuple) else out
        weights = torch.linspace(-1, 1, out.numel(), device=where).view(out.shape)
        (out.float() * weights).sum().backward()
        outputs.append(out.detach().cpu())
        grads.append([p.grad.cpu() for p in m.parameters()] +
                     [x.grad.cpu() for x in args if x.is_floating_point()])
    torch.testing.assert_close(outputs[1], outputs[0], atol=atol, rtol=1e-4)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


def _hidden():
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("build", [
    lambda: ColumnParallelLinear(H, 3 * H, None),
    lambda: RowParallelLinear(H, H, None),
    lambda: LayerNorm(H, 1e-5),
    lambda: RMSNorm(H, 1e-5),
    lambda: ParallelMLP(GPT2, None),
    lambda: ParallelMLP(LLAMA, None),
    lambda: ParallelAttention(GPT2, None, causal=True, recompute_core=False),
    lambda: TransformerLayer(GPT2, None, causal=True),
], ids=["column", "row", "layernorm", "rmsnorm", "mlp-gelu", "mlp-swiglu", "attention",
        "layer"])
def test_layer_on_the_device_matches_the_cpu(build, device):
    _compare(_randomised(build()), [_hidden()], device)


def test_grouped_query_attention_with_rotary_on_the_device_matches_the_cpu(device):
    """On CUDA k and v go to scaled_dot_product_attention one per group (enable_gqa); on the CPU
    they are repeated: the same function."""
    from megatron_2bw.models.transformer import RotaryEmbedding

    class WithRotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = ParallelAttention(LLAMA, None, causal=True, recompute_core=False)
            self.rotary = RotaryEmbedding(LLAMA)

        def forward(self, x):
            return self.attention(x, None, self.rotary(S, device=x.device))
    _compare(_randomised(WithRotary()), [_hidden()], device)


def test_embedding_and_vocab_parallel_cross_entropy_on_the_device_match_the_cpu(device):
    ids = torch.randint(0, 200, (B, S), generator=torch.Generator().manual_seed(2))
    _compare(_randomised(VocabParallelEmbedding(200, H, None)), [ids], device)

    class Loss(torch.nn.Module):
        def forward(self, logits):
            return vocab_parallel_cross_entropy(logits, ids.to(logits.device), None, 190)
    _compare(Loss(), [torch.randn(B, S, 200, generator=torch.Generator().manual_seed(3))], device)


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_whole_model_built_on_the_device_matches_the_cpu(config, device):
    """Built directly on the device (weights initialised there shard by shard) it holds the CPU
    model's weights and computes its loss and gradients."""
    tokens = torch.randint(0, 200, (B, S + 1), generator=torch.Generator().manual_seed(4))
    on_cpu = build_stage_model(config, None, 1, range(2), True, True, seed=5)
    on_device = build_stage_model(config, None, 1, range(2), True, True, seed=5, device=device)
    for (name, a), b in zip(on_cpu.named_parameters(), on_device.parameters()):
        assert b.device.type == device.type and torch.equal(a, b.cpu()), name
    losses, grads = [], []
    for model, where in ((on_cpu, "cpu"), (on_device, device)):
        loss, _ = model(None, {"tokens": tokens.to(where)})
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.cpu() for p in model.parameters()])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_blocks_on_the_device_match_the_cpu(dtype, causal, device):
    """One ring-attention block, forward (output, log-sum-exp) and backward given them, on CUDA
    (the flash kernel in bf16, the written-out block in fp32) against the CPU's flash kernel."""
    from megatron_2bw.models.ring_attention import _block_backward, _block_forward, _flash_kernel
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(B, 4, 16, 64, generator=generator).to(dtype) for _ in range(4))
    results = []
    for where in (torch.device("cpu"), device):
        args = [t.to(where) for t in (q, k, v)]
        out, lse, _ = _block_forward(*args, causal, None, 0.0, 0.125)
        grads = _block_backward(grad.to(where), *args, out.to(dtype), lse, causal, None, None,
                                0.0, 0.125)
        results.append([t.float().cpu() for t in (out, lse, *grads)])
    assert _flash_kernel(q.to(device), None, 0.0) == ("cuda" if dtype == torch.bfloat16 else None)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
