"""The norms' kernels: RMSNorm through torch's fused rms_norm off the CPU (its fp32
decomposition on the CPU computes the same function), and apex's LayerNorm only on request
(--memory-efficient-layer-norm), refused where apex is missing, with RMSNorm or with compiled
layers."""
import pytest
import torch
import torch.nn.functional as F

from megatron_2bw.config import Config, ConfigError
from megatron_2bw.config_checks import validate
from megatron_2bw.models import transformer
from megatron_2bw.models.transformer import RMSNorm, rms_norm_in_fp32


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_torch_rms_norm_is_the_cpu_decomposition(dtype, tolerance):
    """F.rms_norm (what a CUDA tensor runs) against the decomposition, forward and backward."""
    torch.manual_seed(0)
    x = (3 * torch.randn(2, 8, 64)).to(dtype).requires_grad_()
    gain = (1 + torch.randn(64) / 10).to(dtype).requires_grad_()
    out = torch.randn(2, 8, 64, dtype=dtype)
    fused = F.rms_norm(x, (64,), gain, 1e-5)
    grads = torch.autograd.grad((fused.float() * out).sum(), (x, gain))
    reference = rms_norm_in_fp32(x, gain, 1e-5)
    reference_grads = torch.autograd.grad((reference.float() * out).sum(), (x, gain))
    torch.testing.assert_close(fused, reference, atol=tolerance, rtol=tolerance)
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got, want, atol=tolerance * 10, rtol=tolerance)


def test_rms_norm_module_on_the_cpu_is_the_decomposition():
    norm = RMSNorm(16, 1e-6, zero_centered=True)
    torch.nn.init.normal_(norm.weight, std=0.1)
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), norm.gain(), 1e-6))


def _config(**model) -> Config:
    config = Config()
    config.model.num_layers, config.model.hidden_size, config.model.num_attention_heads = 2, 32, 4
    config.model.seq_length, config.model.max_position_embeddings = 16, 16
    config.training.micro_batch_size, config.training.train_iters = 1, 1
    config.model.memory_efficient_layer_norm = True
    for name, value in model.items():
        setattr(config.model, name, value)
    return config


def test_apex_layer_norm_refused_where_it_cannot_serve(monkeypatch):
    monkeypatch.setattr(transformer, "_apex_layer_norm", None)
    with pytest.raises(ConfigError, match="apex .* does not import here"):
        validate(_config(), require_data=False)
    monkeypatch.setattr(transformer, "_apex_layer_norm", lambda *args: None)  # apex installed
    validate(_config(), require_data=False)
    with pytest.raises(ConfigError, match="applies to --normalization LayerNorm, got RMSNorm"):
        validate(_config(normalization="RMSNorm"), require_data=False)
    compiled = _config()
    compiled.training.torch_compile = True
    with pytest.raises(ConfigError, match="split each compiled layer's graph"):
        validate(compiled, require_data=False)


def test_layer_norm_runs_apex_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(transformer, "_apex_layer_norm", lambda *args: calls.append(args))
    x = torch.randn(2, 8)
    plain, asked = transformer.LayerNorm(8, 1e-5), transformer.LayerNorm(8, 1e-5, apex=True)
    with torch.no_grad():
        for norm in (plain, asked):
            norm.weight.fill_(1.0), norm.bias.zero_()
    torch.testing.assert_close(plain(x), F.layer_norm(x, (8,), eps=1e-5))
    torch.testing.assert_close(asked(x), plain(x))  # a CPU tensor: apex's kernel is CUDA's
    assert not calls
