"""The optimizer: state allocated up front changes nothing, and apex is optional (a missing or
unrelated `apex` package silently selects torch's own LayerNorm and AdamW)."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.optim.optimizer import build_torch_optimizer, initialize_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trajectory(opt: OptimizerConfig, eager: bool, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    grads = [[torch.randn_like(p) for p in params] for _ in range(steps)]
    optimizer = build_torch_optimizer(params, opt)
    if eager:
        initialize_state(optimizer)
        assert all(torch.count_nonzero(v) == 0 for s in optimizer.state.values()
                   for v in s.values())
        assert len(optimizer.state) == (2 if opt.optimizer == "adam" or opt.sgd_momentum else 0)
        assert all(p.grad is None for p in params)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("opt", [
    OptimizerConfig(optimizer="adam", lr=0.1, weight_decay=0.1),
    OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.1, sgd_momentum=0.9),
    OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.1, sgd_momentum=0.0)])
def test_state_allocated_up_front_gives_the_same_steps(opt):
    lazy, eager = trajectory(opt, eager=False), trajectory(opt, eager=True)
    assert all(torch.equal(a, b) for a, b in zip(lazy, eager))


def test_without_apex_torch_layers_serve_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from megatron_2bw.models import transformer
        from megatron_2bw.optim import optimizer
    assert transformer._apex_layer_norm is None and optimizer._ApexFusedAdam is None
    norm = transformer.LayerNorm(8, 1e-5)
    for parameter in norm.parameters():  # created empty (the model's init fills them): define
        torch.nn.init.normal_(parameter)  # them, or reused memory may hold NaNs
    x = torch.randn(2, 8)
    assert torch.equal(norm(x), F.layer_norm(x, (8,), norm.weight, norm.bias, 1e-5))
    params = [torch.nn.Parameter(torch.ones(2, 2))]
    assert type(build_torch_optimizer(params, OptimizerConfig())) is torch.optim.AdamW


def test_an_unrelated_apex_package_is_ignored_without_warnings(tmp_path):
    """PyPI's `apex` is a web toolkit: it imports, but has no apex.normalization."""
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("")
    code = ("import apex, megatron_2bw.models.transformer as t, megatron_2bw.optim.optimizer as o\n"
            "assert apex.__file__.startswith(%r)\n"
            "assert t._apex_layer_norm is None and o._ApexFusedAdam is None\n" % str(tmp_path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "" and run.stdout == ""
