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
