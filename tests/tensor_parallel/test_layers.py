"""Each tensor-parallel layer (t = 2 and 4) equals its single-process counterpart to 1e-5 (fp32):
outputs, input gradients and (reassembled) weight gradients."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_2bw.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                 VocabParallelEmbedding, initialize_parameters)
from tests.distributed_helpers import run_ranks

IN, OUT, VOCAB = 8, 12, 16


def _full(param) -> torch.Tensor:
    """All-gather a sharded parameter (or its gradient) along its partition dimension."""
    spec = param.spec
    if spec.partition_dim is None:
        return param.detach()
    parts = [torch.empty_like(param) for _ in range(spec.tp_size)]
    dist.all_gather(parts, param.detach().contiguous())
    return torch.cat(parts, dim=spec.partition_dim)


def _full_grad(param) -> torch.Tensor:
    spec = param.spec
    if spec.partition_dim is None:
        return param.grad
    parts = [torch.empty_like(param.grad) for _ in range(spec.tp_size)]
    dist.all_gather(parts, param.grad.contiguous())
    return torch.cat(parts, dim=spec.partition_dim)


def _check_layer(rank, world, kind):
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    x = torch.randn(3, 5, IN)
    if kind == "column":
        layer = ColumnParallelLinear(IN, OUT, group, gather_output=True)
    elif kind == "row":
        layer = RowParallelLinear(OUT, IN, group, input_is_parallel=False)
        x = torch.randn(3, 5, OUT)
    else:
        layer = VocabParallelEmbedding(VOCAB, IN, group)
        x = torch.randint(0, VOCAB, (3, 5))
    initialize_parameters(layer, seed=3, std=0.5, num_layers=2)
    for p in layer.parameters():  # non-zero biases make the check meaningful
        p.data.add_(0.1 * (p.spec.tp_rank + 1) * (p.spec.partition_dim is not None))
    weight, bias = _full(layer.weight), (_full(layer.bias) if getattr(layer, "bias", None) is not None else None)
    x_parallel = x.clone().float().requires_grad_(kind != "embedding") if kind != "embedding" else x
    y = layer(x_parallel)
    upstream = torch.randn_like(y, generator=torch.Generator().manual_seed(1))
    (y * upstream).sum().backward()

    ref_w = weight.clone().requires_grad_()
    ref_b = bias.clone().requires_grad_() if bias is not None else None
    x_ref = x.clone().float().requires_grad_() if kind != "embedding" else x
    y_ref = F.embedding(x_ref, ref_w) if kind == "embedding" else F.linear(x_ref, ref_w, ref_b)
    (y_ref * upstream).sum().backward()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_full_grad(layer.weight), ref_w.grad, atol=1e-5, rtol=1e-5)
    if ref_b is not None:
        torch.testing.assert_close(_full_grad(layer.bias), ref_b.grad, atol=1e-5, rtol=1e-5)
    if kind != "embedding":
        torch.testing.assert_close(x_parallel.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["column", "row", "embedding"])
def test_layer_matches_single_process(kind, world):
    assert all(run_ranks(world, _check_layer, kind))


def _uneven(rank, world):
    group = dist.new_group(list(range(world)))
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        ColumnParallelLinear(4, 3, group)
    return True


def test_uneven_partition_is_a_clear_error():
    assert all(run_ranks(2, _uneven))


class _DrawnSizes(torch.utils._python_dispatch.TorchDispatchMode):
    """The element counts of the tensors filled by normal_ (the initialiser's host draws)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.normal_.default:
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("t", [1, 2, 4])
def test_weights_are_initialised_shard_by_shard_as_drawn_for_the_full_tensor(t, monkeypatch):
    """Each rank's shard holds its part of the full tensor one seeded draw would give (so the
    weights do not depend on t), yet no draw is larger than a chunk."""
    import math
    import zlib

    from megatron_2bw.config import ModelConfig
    from megatron_2bw.distributed.comm import ShardShapeGroup
    from megatron_2bw.models import build_stage_model
    from megatron_2bw.tensor_parallel import layers
    monkeypatch.setattr(layers, "INIT_CHUNK_ELEMENTS", 200)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                         vocab_size=101, make_vocab_size_divisible_by=8)
    for rank in range(t):
        drawn = _DrawnSizes()
        with drawn:
            model = build_stage_model(config, ShardShapeGroup(t, rank) if t > 1 else None, t,
                                      range(2), True, True, seed=7)
        assert 0 < max(drawn.sizes) <= 200 + 16
        for name, param in model.named_parameters():
            spec = param.spec
            generator = torch.Generator().manual_seed(7 * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.empty(spec.full_shape)
            if spec.init in ("zeros", "ones"):
                full.fill_(float(spec.init == "ones"))
            else:
                std = config.init_method_std
                full.normal_(0.0, std / math.sqrt(4.0) if spec.init == "output" else std,
                             generator=generator)
            if spec.partition_dim is not None:
                full = full.chunk(t, dim=spec.partition_dim)[rank]
            assert torch.equal(param.detach(), full), name
