"""--optimizer muon: torch.optim.Muon's update for the hidden matrices and torch's AdamW for the
rest, each checked against torch's own optimizer over the same parameters and gradients."""
import pytest
import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.optim.muon import Muon, newton_schulz, update_scale
from megatron_2bw.optim.optimizer import build_torch_optimizer, initialize_state

# (name, shape): one of each kind Muon and AdamW split between them
PARAMS = [("embedding.word_embeddings.weight", (16, 8)),
          ("embedding.position_embeddings.weight", (6, 8)),
          ("layers.0.input_norm.weight", (8,)), ("layers.0.attention.qkv.weight", (24, 8)),
          ("layers.0.attention.qkv.bias", (24,)), ("layers.0.mlp.fc2.weight", (8, 32)),
          ("output_layer", (16, 8))]
HIDDEN = {"layers.0.attention.qkv.weight", "layers.0.mlp.fc2.weight"}


def make_params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape)) for _, shape in PARAMS]


def gradients(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for _, shape in PARAMS]
            for _ in range(steps)]


def run(optimizers, params, grads):
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        for optimizer in optimizers:
            optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("mode,extra,torch_fn", [("shape_scaling", 1.0, "original"),
                                                 ("spectral", 0.2, "match_rms_adamw")])
def test_equals_torch_muon_for_matrices_and_adamw_for_the_rest(nesterov, mode, extra, torch_fn):
    opt = OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.1, adam_beta1=0.8,
                          adam_beta2=0.95, adam_eps=1e-6, muon_momentum=0.9,
                          muon_use_nesterov=nesterov, muon_num_ns_steps=4,
                          muon_scale_mode=mode, muon_extra_scale_factor=extra)
    grads = gradients(4)
    mine = make_params()
    optimizer = build_torch_optimizer(mine, opt, [name for name, _ in PARAMS])
    initialize_state(optimizer)
    got = run([optimizer], mine, grads)

    ref = make_params()
    hidden = [p for (name, _), p in zip(PARAMS, ref) if name in HIDDEN]
    rest = [p for (name, _), p in zip(PARAMS, ref) if name not in HIDDEN]
    torch_muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.9,
                                  nesterov=nesterov, ns_steps=4, adjust_lr_fn=torch_fn)
    decayed = [p for p in rest if p.dim() > 1]
    torch_adamw = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1},
         {"params": [p for p in rest if p.dim() == 1], "weight_decay": 0.0}],
        lr=0.02, betas=(0.8, 0.95), eps=1e-6, fused=True)
    want = run([torch_muon, torch_adamw], ref, grads)
    for (name, _), a, b in zip(PARAMS, got, want):
        assert torch.equal(a, b), name
    kinds = {name: set(optimizer.state[p]) for (name, _), p in zip(PARAMS, mine)}
    for name, keys in kinds.items():
        assert keys == ({"momentum_buffer"} if name in HIDDEN else
                        {"step", "exp_avg", "exp_avg_sq"}), name


def test_groups_roles_and_names_needed():
    params = make_params()
    names = [name for name, _ in PARAMS]
    optimizer = build_torch_optimizer(params, OptimizerConfig(optimizer="muon"), names)
    assert isinstance(optimizer, Muon)
    muon = [g for g in optimizer.param_groups if g["use_muon"]]
    assert len(muon) == 1 and muon[0]["wd_mult"] == 1.0
    assert {id(p) for p in muon[0]["params"]} == \
        {id(p) for (name, _), p in zip(PARAMS, params) if name in HIDDEN}
    with pytest.raises(ValueError, match="--optimizer muon"):
        build_torch_optimizer(params, OptimizerConfig(optimizer="muon"))


def test_unit_rms_norm_scale_and_orthogonal_update():
    assert update_scale((24, 8), "unit_rms_norm", 0.5) == pytest.approx(0.5 * 3 ** 0.5)
    assert update_scale((8, 32), "shape_scaling", 1.0) == 1.0
    assert update_scale((8, 32), "spectral", 1.0) == pytest.approx(32 ** 0.5)
    torch.manual_seed(0)
    o = newton_schulz(torch.randn(32, 8), steps=5).float()
    singular = torch.linalg.svdvals(o)  # the quintic iteration leaves them near 1, not at 1
    assert singular.min() > 0.5 and singular.max() < 1.3


def test_on_a_real_model_muon_takes_exactly_the_layers_linear_weights():
    from megatron_2bw.config import ModelConfig
    from megatron_2bw.models import build_stage_model
    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8,
                         vocab_size=50, make_vocab_size_divisible_by=8,
                         untie_embeddings_and_output_weights=True)
    module = build_stage_model(config, None, 1, range(2), True, True, seed=5)
    named = list(module.named_parameters())
    optimizer = build_torch_optimizer([p for _, p in named], OptimizerConfig(optimizer="muon"),
                                      [n for n, _ in named])
    muon_ids = {id(p) for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    on_muon = {n for n, p in named if id(p) in muon_ids}
    assert on_muon == {n for n, p in named if p.dim() == 2 and ".layers." in "." + n} != set()
    assert "output_layer" not in on_muon and not any("embedding" in n for n in on_muon)


MUON_BAD_INPUT = [
    (["--muon-momentum", "0.9"], "--muon-momentum applies to --optimizer muon only"),
    (["--optimizer", "sgd", "--no-muon-use-nesterov"],
     "--muon-use-nesterov applies to --optimizer muon only"),
    (["--muon-num-ns-steps", "3"], "--muon-num-ns-steps applies to --optimizer muon only"),
    (["--optimizer", "muon", "--muon-momentum", "1.0"], "--muon-momentum must be in [0, 1)"),
    (["--optimizer", "muon", "--muon-num-ns-steps", "0"],
     "--muon-num-ns-steps must be an integer from 1 to 99"),
    (["--optimizer", "muon", "--muon-num-ns-steps", "100"],
     "--muon-num-ns-steps must be an integer from 1 to 99"),
    (["--optimizer", "muon", "--muon-extra-scale-factor", "0"],
     "--muon-extra-scale-factor must be > 0"),
    (["--optimizer", "muon", "--muon-scale-mode", "rms"],
     "argument --muon-scale-mode: invalid choice: 'rms'"),
]


@pytest.mark.parametrize("extra,expected", MUON_BAD_INPUT)
def test_bad_muon_flags_are_named(extra, expected):
    from megatron_2bw.arguments import ConfigError, parse_config
    tiny = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2", "--mock-data",
            "--vocab-size", "64"]
    with pytest.raises(ConfigError) as error:
        parse_config([*tiny, *extra])
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_muon_and_adam_flags_fill_the_config_and_one_bad_flag_exits_2():
    import subprocess
    import sys

    from megatron_2bw.arguments import parse_config
    root = __file__.rsplit("/tests/", 1)[0]
    tiny = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2", "--mock-data",
            "--vocab-size", "64"]
    config, _ = parse_config([*tiny, "--optimizer", "muon", "--muon-momentum", "0.9",
                              "--no-muon-use-nesterov", "--muon-num-ns-steps", "6",
                              "--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2",
                              "--adam-beta2", "0.95", "--adam-eps", "1e-6"])
    opt = config.optimizer
    assert (opt.optimizer, opt.muon_momentum, opt.muon_use_nesterov, opt.muon_num_ns_steps,
            opt.muon_scale_mode, opt.muon_extra_scale_factor, opt.adam_beta2, opt.adam_eps) == \
        ("muon", 0.9, False, 6, "spectral", 0.2, 0.95, 1e-6)
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *tiny, "--muon-momentum", "0.9"],
                            cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--muon-momentum applies to --optimizer muon only" in lines[0]
