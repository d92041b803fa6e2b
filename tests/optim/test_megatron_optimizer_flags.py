"""Megatron-LM's optimizer-side flags in one process: --lr-warmup-init, --decoupled-lr and
--decoupled-min-lr (their own parameter groups: the word embeddings and the output layer), and the
weight-decay increment (--start/--end-weight-decay, --weight-decay-incr-style), against values
worked out by hand; and the groups' roles surviving a checkpoint of another configuration."""
import math

import pytest
import torch

from megatron_2bw.checkpoint.save_load import optimizer_state_by_index, optimizer_state_by_name
from megatron_2bw.config import ModelConfig, OptimizerConfig, TrainingConfig
from megatron_2bw.models import build_stage_model
from megatron_2bw.optim.lr_schedule import apply_schedule, learning_rate, weight_decay
from megatron_2bw.optim.optimizer import build_torch_optimizer

TEN_ITERATIONS = TrainingConfig(train_iters=10, global_batch_size=4)


def test_warmup_rises_from_the_warmup_init():
    opt = OptimizerConfig(lr=1.0, lr_warmup_init=0.2, lr_warmup_iters=4, lr_decay_style="constant")
    rates = [learning_rate(i, opt, TEN_ITERATIONS) for i in range(5)]
    assert rates == pytest.approx([0.4, 0.6, 0.8, 1.0, 1.0], rel=1e-12)


def test_decoupled_rate_has_the_same_shape_between_its_own_peak_and_end():
    opt = OptimizerConfig(lr=1.0, min_lr=0.1, decoupled_lr=2.0, decoupled_min_lr=0.5,
                          lr_warmup_init=0.2, lr_warmup_iters=2, lr_decay_iters=6,
                          lr_decay_style="linear")
    # warm-up from 0.2 over 2 iterations, then linear from the peak at step 2 to the end at 6
    assert [learning_rate(i, opt, TEN_ITERATIONS, decoupled=True) for i in range(7)] == \
        pytest.approx([1.1, 2.0, 0.5 + 0.75 * 1.5, 0.5 + 0.5 * 1.5, 0.5 + 0.25 * 1.5, 0.5, 0.5],
                      rel=1e-12)
    assert [learning_rate(i, opt, TEN_ITERATIONS) for i in (0, 2, 5)] == \
        pytest.approx([0.6, 0.1 + 0.75 * 0.9, 0.1], rel=1e-12)
    opt.decoupled_min_lr = None  # falls back to --min-lr
    assert learning_rate(5, opt, TEN_ITERATIONS, decoupled=True) == 0.1


@pytest.mark.parametrize("style,expected", [
    # ratio = step / 10 training iterations, clamped to 1 (steps 1, 5, 10, 20)
    ("linear", [0.01 + 0.1 * 0.09, 0.01 + 0.5 * 0.09, 0.1, 0.1]),
    ("cosine", [0.01 + 0.5 * (math.cos(math.pi * 0.9) + 1) * 0.09, 0.01 + 0.5 * 0.09, 0.1, 0.1])])
def test_weight_decay_increments_from_start_to_end_over_the_training(style, expected):
    opt = OptimizerConfig(start_weight_decay=0.01, end_weight_decay=0.1,
                          weight_decay_incr_style=style)
    assert [weight_decay(i, opt, TEN_ITERATIONS) for i in (0, 4, 9, 19)] == \
        pytest.approx(expected, rel=1e-12)


def test_weight_decay_counts_a_sample_based_training_in_fractional_iterations():
    train = TrainingConfig(train_iters=3, train_samples=40, global_batch_size=16)  # 2.5 iterations
    opt = OptimizerConfig(start_weight_decay=0.0, end_weight_decay=1.0,
                          weight_decay_incr_style="linear")
    assert [weight_decay(i, opt, train) for i in range(3)] == pytest.approx([0.4, 0.8, 1.0])


def test_without_start_and_end_the_decay_is_the_weight_decay_throughout():
    opt = OptimizerConfig(weight_decay=0.03)
    assert {weight_decay(i, opt, TEN_ITERATIONS) for i in range(12)} == {0.03}


def tiny_model(pre_process: bool = True, post_process: bool = True, untied: bool = False):
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                         vocab_size=50, make_vocab_size_divisible_by=8,
                         untie_embeddings_and_output_weights=untied)
    return build_stage_model(config, None, 1, range(1), pre_process, post_process, seed=5)


def named_optimizer(module, opt: OptimizerConfig):
    named = list(module.named_parameters())
    return build_torch_optimizer([p for _, p in named], opt, [n for n, _ in named])


def decoupled_names(optimizer, module) -> set[str]:
    names_of = {id(p): n for n, p in module.named_parameters()}
    return {names_of[id(p)] for g in optimizer.param_groups if g["is_decoupled_lr"]
            for p in g["params"]}


@pytest.mark.parametrize("stages,untied,expected", [
    ((True, True), False, {"embedding.word_embeddings.weight"}),  # p = 1: the head uses them too
    ((True, False), False, {"embedding.word_embeddings.weight"}),  # first of several stages
    ((False, True), False, {"output_embedding"}),  # the last stage's tied copy
    ((True, True), True, {"embedding.word_embeddings.weight", "output_layer"})])
def test_decoupled_groups_hold_the_word_embeddings_and_the_output_layer(stages, untied, expected):
    module = tiny_model(*stages, untied=untied)
    optimizer = named_optimizer(module, OptimizerConfig(decoupled_lr=1e-3, weight_decay=0.1))
    assert decoupled_names(optimizer, module) == expected  # not the position embeddings
    assert all(g["wd_mult"] == float(all(p.dim() > 1 for p in g["params"]))
               for g in optimizer.param_groups)  # the decay split holds in both schedules
    plain = named_optimizer(module, OptimizerConfig(weight_decay=0.1))
    assert [(g["wd_mult"], g["is_decoupled_lr"]) for g in plain.param_groups] == \
        [(1.0, False), (0.0, False)]  # without --decoupled-lr: the two groups of before


def test_an_sgd_step_moves_each_parameter_at_its_groups_rate_and_decay():
    module = tiny_model(untied=True)
    opt = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=0.1, min_lr=0.0, decoupled_lr=0.5,
                          lr_warmup_iters=0, lr_decay_style="linear", start_weight_decay=0.0,
                          end_weight_decay=0.2, weight_decay_incr_style="linear")
    optimizer = named_optimizer(module, opt)
    generator = torch.Generator().manual_seed(0)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    grads = {n: torch.randn(p.shape, generator=generator) for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        p.grad = grads[n].clone()
    iteration = 4  # step 5 of 10: rates at half their peak, decay 0.1
    assert apply_schedule(optimizer.param_groups, iteration, opt, TEN_ITERATIONS) == \
        pytest.approx(0.05)
    optimizer.step()
    decoupled = {"embedding.word_embeddings.weight", "output_layer"}
    for n, p in module.named_parameters():
        rate = 0.25 if n in decoupled else 0.05
        decay = 0.1 if p.dim() > 1 else 0.0
        expected = before[n] - rate * (grads[n] + decay * before[n])
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7, msg=n)


def test_loaded_groups_keep_this_runs_roles():
    """A checkpoint saved without --decoupled-lr, loaded by a run with it (checkpoints match groups
    by their first parameter): the embeddings keep their own schedule."""
    module = tiny_model(untied=True)
    names_of = {id(p): n for n, p in module.named_parameters()}
    saved = optimizer_state_by_name(named_optimizer(module, OptimizerConfig()), names_of)
    optimizer = named_optimizer(module, OptimizerConfig(decoupled_lr=1e-3))
    optimizer.load_state_dict(optimizer_state_by_index(optimizer, saved, names_of))
    assert decoupled_names(optimizer, module) == {"embedding.word_embeddings.weight", "output_layer"}
    assert [g["wd_mult"] for g in optimizer.param_groups] == [1.0, 0.0, 1.0]
