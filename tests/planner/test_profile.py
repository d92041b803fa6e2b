import dataclasses
import json
import math
import os
import threading

import pytest
import torch

from megatron_2bw.config import Config, ModelConfig, PrecisionConfig, TrainingConfig
from megatron_2bw.planner import memory as planner_memory
from megatron_2bw.planner import measured_profile as measured_module
from megatron_2bw.planner.analytic_profile import AnalyticProfile, gemm
from megatron_2bw.planner.hardware import HardwareSpec, load_hardware
from megatron_2bw.planner.measured_profile import (MeasuredProfile, measure_costs,
                                                   measure_costs_at_once, measure_costs_per_copy,
                                                   measure_turn_taking, measured_profile,
                                                   profiling_processes, saved_activation_bytes,
                                                   turn_taking_processors)
from megatron_2bw.planner.memory import MASK_BYTES, layer_parameters, unfused_attention
from megatron_2bw.planner.profile import attention_flops_per_token, linear_flops_per_token
from megatron_2bw.training.progress import model_flops_per_sample
from tests.planner.test_memory import LLAMA_SWITCHES, layer_activation_bytes

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=1000)
LLAMA = dataclasses.replace(MODEL, **LLAMA_SWITCHES, ffn_hidden_size=128)  # 2 groups of 2 heads
# --kv-channels: heads wider than h/a (4 of 32: the attention 2h wide), and heads that do not
# divide the hidden size (6 of 16: 1.5h wide)
WIDE_HEADS = dataclasses.replace(MODEL, kv_channels=32)
UNEVEN_HEADS = dataclasses.replace(MODEL, num_attention_heads=6, kv_channels=16)
HARDWARE = HardwareSpec(name="toy", devices_per_node=8, nodes=1, memory_per_device_bytes=1e10,
                        intra_node_bandwidth=1e10, intra_node_latency_s=1e-5,
                        inter_node_bandwidth=1e9, inter_node_latency_s=1e-4,
                        peak_flops={"float32": 1e12, "bfloat16": 4e12}, memory_bandwidth=1e11,
                        efficiency=0.5, device_type="cpu")


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("model, a, width", [(MODEL, 4, 64), (WIDE_HEADS, 4, 128),
                                             (UNEVEN_HEADS, 6, 96)],
                         ids=["gpt2", "wide-heads", "uneven-heads"])
def test_analytic_layer_time_is_each_gemm_on_its_roofline_plus_bytes_over_bandwidth(model, a,
                                                                                    width, t):
    """The attention is `width` (a heads x head size) wide where it is not h (--kv-channels): QKV
    projects h to 3 x width, the dense projection width back to h, the scores and their product
    with V multiply over it, and so do the q/k copies and the context's layout copy (6e); the
    norms, biases, dropouts and residuals (replicated) and the MLP stay h-wide. Each linear takes
    the longer of its FLOPs at the attainable rate and its operands' bytes at the bandwidth."""
    b, s, h, f, e = 2, 32, 64, 256, 4
    sb = s * b
    linears = [(h, 3 * width / t), (width / t, h), (h, f / t), (f / t, h)]  # (inner, columns)
    gemms = sum(max(2 * sb * k * n / 0.5e12, e * (sb * k + k * n + sb * n) / 0.5e11)
                for k, n in linears)
    flops = 4 * b * s * s * width / t  # the attention core's
    moved = (18 * e + 2) * s * b * h + (6 * e * s * b * width + 2 * e * s * b * f) / t + \
        (8 * e + 1) * a * s * s * b / t
    costs = AnalyticProfile(model, PrecisionConfig(), HARDWARE).costs(t, b)
    assert costs.layer_forward_s == pytest.approx(gemms + flops / 0.5e12 + moved / 0.5e11)
    accumulation = (4 + 2 * 4) * layer_parameters(model, t)  # read 2 buffers, write 1 (fp32)
    assert costs.layer_backward_s == pytest.approx(
        2 * gemms + 2 * flops / 0.5e12 + (2 * moved + accumulation) / 0.5e11)
    assert costs.layer_activation_bytes == layer_activation_bytes(model, t, b, e)
    # bf16: the bf16 peak, 2-byte activations
    half = AnalyticProfile(model, PrecisionConfig(bf16=True), HARDWARE).costs(t, b)
    assert half.layer_forward_s < costs.layer_forward_s
    assert half.layer_activation_bytes == layer_activation_bytes(model, t, b, 2)


def test_analytic_matmul_flops_follow_the_llama_switches():
    """QKV projects to (4 heads + 2 x 2 groups) x 16 = 2h features, SwiGLU's fc1 to 2f: with
    memory traffic and launches free, the layer's time is its matmul FLOPs over the peak."""
    b, s, h, f = 2, 32, 64, 128
    flops = 2 * b * s * (2 * h * h + h * h + 2 * f * h + f * h) + 4 * b * s * s * h
    compute_only = dataclasses.replace(HARDWARE, memory_bandwidth=1e30, kernel_overhead_s=0.0)
    costs = AnalyticProfile(LLAMA, PrecisionConfig(), compute_only).costs(1, b)
    assert costs.layer_forward_s == pytest.approx(flops / 0.5e12)
    assert costs.layer_backward_s == pytest.approx(2 * flops / 0.5e12)
    assert linear_flops_per_token(MODEL) == 24 * h * h  # GPT-2's layout, f = 4h
    swiglu = dataclasses.replace(MODEL, swiglu=True)  # f = 4h: fc1 2f x h, fc2 h x f
    assert linear_flops_per_token(swiglu) == 2 * h * (4 * h + 12 * h)
    # --kv-channels 32: 4 heads of 32 (2h) and 2 x 2 groups of 32 (2h): QKV 4h features, the
    # dense projection 2h x h, the scores over 2h; one rank of t = 2 does half
    wide = dataclasses.replace(LLAMA, kv_channels=32)
    wide_flops = 2 * b * s * (4 * h * h + 2 * h * h + 2 * f * h + f * h) + 4 * b * s * s * 2 * h
    costs = AnalyticProfile(wide, PrecisionConfig(), compute_only).costs(2, b)
    assert costs.layer_forward_s == pytest.approx(wide_flops / 2 / 0.5e12)
    assert linear_flops_per_token(UNEVEN_HEADS) == 2 * h * (4.5 * h + 1.5 * h + 8 * h)
    assert attention_flops_per_token(UNEVEN_HEADS) == 4 * s * 1.5 * h


# h = 64 and s = 32 below: the linears' FLOPs per token and the attention's width
@pytest.mark.parametrize("model, linears, attention_width", [
    (MODEL, 24 * 64 * 64, 64),
    (LLAMA, 2 * 64 * (2 * 64 + 64 + 2 * 128 + 128), 64),
    (UNEVEN_HEADS, 2 * 64 * (4.5 * 64 + 1.5 * 64 + 8 * 64), 96),  # 6 heads of 16
], ids=["gpt2", "llama", "uneven"])
def test_logged_model_flops_follow_the_architecture(model, linears, attention_width):
    """The log's throughput figure (training/progress.py): 3 x tokens x (layers x (linears +
    4s·ad) + logits), the attention a heads of d channels wide."""
    h, s, layers, vocab = 64, 32, 2, 1000
    config = Config(model=model, training=TrainingConfig(global_batch_size=8))
    assert model_flops_per_sample(config) == \
        3 * s * (layers * (linears + 4 * s * attention_width) + 2 * h * vocab)


@pytest.mark.parametrize("model, forward, backward", [
    # forward: 4 linears, 2 LayerNorms, 2 x (bias, dropout, residual), GELU, a layout copy, and
    # the attention core's 8; backward: twice that, 8 weight-gradient kernels, 12 accumulations
    (MODEL, 22, 64),
    # 4 linears, 2 x (dropout, residual), silu and product, the layout copy, 2 x 6 for RMSNorm in
    # fp32, k and v repeated and q copied out of its groups, 2 x 5 for rotary embeddings, the
    # core's 8; backward: twice that, 4 weight-gradient kernels, 6 accumulations
    (LLAMA, 44, 98),
    # GPT-2's and 2 LayerNorms over q and k, each of the 4 norms adding 1 to its weight; backward:
    # twice that, 8 weight-gradient kernels, 16 accumulations
    (dataclasses.replace(MODEL, qk_layernorm=True, apply_layernorm_1p=True), 28, 80),
], ids=["gpt2", "llama", "gpt2-qk-1p"])
def test_analytic_kernel_launches_cost_a_fixed_time_per_microbatch(model, forward, backward):
    slow = dataclasses.replace(HARDWARE, kernel_overhead_s=1e-3)
    plain = AnalyticProfile(model, PrecisionConfig(), HARDWARE).costs(1, 2)
    costly = AnalyticProfile(model, PrecisionConfig(), slow).costs(1, 2)
    assert costly.layer_forward_s - plain.layer_forward_s == pytest.approx(forward * 1e-3)
    assert costly.layer_backward_s - plain.layer_backward_s == pytest.approx(backward * 1e-3)


@pytest.mark.parametrize("model, width, head", [(MODEL, 64, 16), (WIDE_HEADS, 128, 32),
                                                 (UNEVEN_HEADS, 96, 16)],
                         ids=["gpt2", "wide-heads", "uneven-heads"])
def test_analytic_qk_layernorm_runs_two_norms_over_this_ranks_heads(model, width, head):
    """Two LayerNorms (read, write) over q and k of this rank's heads (`width` = heads x head
    size channels each) and the whole sequence, also under --sequence-parallel; the backward
    moves twice that and accumulates their gradients."""
    memory_only = dataclasses.replace(HARDWARE, peak_flops={"float32": 1e30},
                                      kernel_overhead_s=0.0)
    b, sb, e = 2, 2 * 32, 4
    for switches in ({}, {"sequence_parallel": True}):
        plain = AnalyticProfile(dataclasses.replace(model, **switches), PrecisionConfig(),
                                memory_only)
        qk = AnalyticProfile(dataclasses.replace(model, qk_layernorm=True, **switches),
                             PrecisionConfig(), memory_only)
        for t in (1, 2):
            normed = 2 * e * 2 * sb * width / t  # q and k alike (one group per head)
            accumulated = (4 + 2 * 4) * 4 * head  # two norms' weights and biases over a head
            assert qk.costs(t, b).layer_forward_s - plain.costs(t, b).layer_forward_s == \
                pytest.approx(normed / 0.5e11)
            assert qk.costs(t, b).layer_backward_s - plain.costs(t, b).layer_backward_s == \
                pytest.approx((2 * normed + accumulated) / 0.5e11)


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("heads, head", [(4, 16), (4, 32), (6, 16)],
                         ids=["h-over-a", "wide-heads", "uneven-heads"])
def test_analytic_attention_layout_moves_the_heads_channels(heads, head, t):
    """Llama's 2 query groups with rotary embeddings: k and v repeated to every query head (read
    the groups' channels, write the heads'), q copied out of the 2 groups a rank holds at t = 1,
    q and k rotated (10e per channel): all over heads x head size channels, whatever h is."""
    model = dataclasses.replace(LLAMA, num_attention_heads=heads, kv_channels=head)
    e, sb = 4, 2 * 32
    q, kv = heads * head, 2 * head
    repeated = 2 * (kv + q) + (2 * q if t == 1 else 0)
    rotated = 10 * (q + kv)
    layout = AnalyticProfile(model, PrecisionConfig(), HARDWARE).attention_layout(t, 2)
    assert layout.bytes == pytest.approx(e * sb * (repeated + rotated) / t)


def test_analytic_fp32_softmax_keeps_the_fused_attention_by_default():
    fp32_softmax = dataclasses.replace(MODEL, attention_softmax_in_fp32=True)
    bf16 = PrecisionConfig(bf16=True)
    assert AnalyticProfile(fp32_softmax, bf16, HARDWARE).costs(1, 2) == \
        AnalyticProfile(MODEL, bf16, HARDWARE).costs(1, 2)


def test_analytic_fp32_softmax_runs_the_unfused_attention_under_half_precision(
        reduced_precision_math_attention):
    """bf16: per score the fp32 chain's 32 + 4e bytes and the dropout's 2e + mask, instead of the
    SDPA math path's 8e + mask; 13 kernels instead of 8 (q and k made batch-contiguous, two
    batched matmuls, casts to fp32 and back, scaling, masking, softmax, the causal mask built and
    inverted, dropout); BERT's given mask is only inverted. Without attention dropout neither its
    bytes nor its kernel. fp32: unchanged."""
    bf16 = PrecisionConfig(bf16=True)
    memory_only = dataclasses.replace(HARDWARE, peak_flops={"bfloat16": 1e30},
                                      kernel_overhead_s=0.0)
    launches_only = dataclasses.replace(HARDWARE, peak_flops={"bfloat16": 1e30},
                                        memory_bandwidth=1e30, kernel_overhead_s=1e-3)
    b, e, scores = 2, 2, 4 * 32 * 32 * 2
    fp32_softmax = dataclasses.replace(MODEL, attention_softmax_in_fp32=True)
    for hardware, extra in ((memory_only, (32 - 2 * e) * scores / 0.5e11),
                            (launches_only, 5 * 1e-3)):
        plain = AnalyticProfile(MODEL, bf16, hardware).costs(1, b)
        unfused = AnalyticProfile(fp32_softmax, bf16, hardware).costs(1, b)
        assert unfused.attention_core_forward_s - plain.attention_core_forward_s == \
            pytest.approx(extra)
        assert unfused.layer_forward_s - plain.layer_forward_s == pytest.approx(extra)
        assert unfused.layer_backward_s - plain.layer_backward_s == pytest.approx(2 * extra)
    bert = ModelConfig(model_type="bert", num_layers=2, hidden_size=64, num_attention_heads=4,
                       seq_length=32, vocab_size=1000, attention_softmax_in_fp32=True)
    no_dropout = dataclasses.replace(fp32_softmax, attention_dropout=0.0)
    gpt_core, bert_core, no_dropout_core = (
        AnalyticProfile(model, bf16, HARDWARE).attention_core(1, b)
        for model in (fp32_softmax, bert, no_dropout))
    assert (gpt_core.kernels, bert_core.kernels, no_dropout_core.kernels) == (13, 11, 12)
    assert gpt_core.bytes - no_dropout_core.bytes == (2 * e + MASK_BYTES) * scores
    unfused = AnalyticProfile(fp32_softmax, bf16, HARDWARE).costs(1, b)
    assert unfused.layer_activation_bytes == layer_activation_bytes(fp32_softmax, 1, b, e)
    assert AnalyticProfile(fp32_softmax, PrecisionConfig(), HARDWARE).costs(1, b) == \
        AnalyticProfile(MODEL, PrecisionConfig(), HARDWARE).costs(1, b)


def test_analytic_tensor_parallel_shard_is_cheaper_but_not_by_t():
    profile = AnalyticProfile(MODEL, PrecisionConfig(), HARDWARE)
    one, two = profile.costs(1, 4), profile.costs(2, 4)
    # LayerNorms, dropouts and residuals are replicated over the tensor-parallel group
    assert one.layer_forward_s / 2 < two.layer_forward_s < one.layer_forward_s
    assert two.head_forward_s == pytest.approx(one.head_forward_s / 2, rel=0.05)


def test_saved_tensor_count_of_the_real_layer():
    """Without dropout PyTorch runs fused attention on the CPU: it keeps Q, K, V (one storage),
    its output (which is also the dense layer's input) and a log-sum-exp per row."""
    model = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0)
    body = measured_module._piece(model, 1, 1, False, False, torch.float32, torch.device("cpu"))
    layer = next(iter(body.transformer.layers.values()))
    b, s, h, a, e = 2, 32, 64, 4, 4
    none, selective = saved_activation_bytes(layer, torch.randn(b, s, h, requires_grad=True))
    # LN inputs (2), QKV and fc1 inputs (2), Q/K/V (3), attention output (1), GELU in/out (4 + 4)
    stashed = 16 * e * s * b * h
    norm_statistics = 2 * 2 * 4 * b * s  # mean and rstd of two LayerNorms, fp32
    assert none == stashed + norm_statistics + 4 * a * s * b
    assert selective == stashed + norm_statistics  # the core's log-sum-exp is recomputed


def cpu_layer_bytes(model: ModelConfig, t: int, b: int, e: int, selective: bool) -> float:
    """layer_activation_bytes as PyTorch on a CPU stashes them: its dropout keeps the mask in the
    working dtype (e bytes, not MASK_BYTES), and the norms keep their statistics per row
    (LayerNorm a mean and an rstd, RMSNorm an fp32 rsqrt): a row per token for the layer's two
    norms (and, like the hidden masks, s/t tokens under --sequence-parallel), per token and head
    of this rank's q and k for --qk-layernorm's."""
    s, h, sb = model.seq_length, model.hidden_size, model.seq_length * b
    r = model.sequence_ranks(t)
    attention_dropout = model.attention_dropout > 0 and not selective
    masks = 2 * sb * h / r + attention_dropout * model.num_attention_heads * s * s * b / t
    rows = 2 * sb / r + model.qk_layernorm * sb * (model.num_attention_heads
                                                   + model.query_groups) / t
    statistics = rows * (2 * e if model.normalization == "LayerNorm" else 4)
    return layer_activation_bytes(model, t, b, e, selective) + (e - MASK_BYTES) * masks + statistics


ONE_GROUP_PER_HEAD = dataclasses.replace(LLAMA, num_query_groups=None)  # rotary q, k; v a view
# --qk-layernorm: LayerNorms over views of the QKV output; RMSNorms over q copied out of groups
QK_LAYERNORM = dataclasses.replace(MODEL, qk_layernorm=True, apply_layernorm_1p=True)
LLAMA_QK = dataclasses.replace(LLAMA, qk_layernorm=True)
ONE_GROUP_PER_HEAD_QK = dataclasses.replace(ONE_GROUP_PER_HEAD, qk_layernorm=True)
# bf16: Megatron-LM's unfused attention (layer scaling implies the fp32 softmax); Llama's
# without attention dropout
LAYER_SCALING = dataclasses.replace(MODEL, apply_query_key_layer_scaling=True)
LLAMA_QK_FP32_SOFTMAX = dataclasses.replace(LLAMA_QK, attention_softmax_in_fp32=True,
                                            attention_dropout=0.0)
# --kv-channels: 4 heads of 32 (2h), 6 heads of 16 (1.5h; Llama's in 2 groups of 3)
QK_LAYERNORM_WIDE_HEADS = dataclasses.replace(QK_LAYERNORM, kv_channels=32)
LLAMA_QK_WIDE_HEADS = dataclasses.replace(LLAMA_QK, kv_channels=32)
LLAMA_MHA_UNEVEN_HEADS = dataclasses.replace(ONE_GROUP_PER_HEAD, num_attention_heads=6,
                                             kv_channels=16)
LLAMA_QK_FP32_SOFTMAX_UNEVEN_HEADS = dataclasses.replace(LLAMA_QK_FP32_SOFTMAX,
                                                         num_attention_heads=6, kv_channels=16)


@pytest.mark.parametrize("t, sequence_parallel", [(1, False), (2, False), (2, True)],
                         ids=["t1", "t2", "t2-sequence-parallel"])
@pytest.mark.parametrize("model", [MODEL, LLAMA, ONE_GROUP_PER_HEAD, QK_LAYERNORM, LLAMA_QK,
                                   ONE_GROUP_PER_HEAD_QK, LAYER_SCALING, LLAMA_QK_FP32_SOFTMAX,
                                   WIDE_HEADS, UNEVEN_HEADS, QK_LAYERNORM_WIDE_HEADS,
                                   LLAMA_QK_WIDE_HEADS, LLAMA_MHA_UNEVEN_HEADS,
                                   LLAMA_QK_FP32_SOFTMAX_UNEVEN_HEADS],
                         ids=["gpt2", "llama", "llama-mha", "gpt2-qk", "llama-qk", "llama-mha-qk",
                              "gpt2-layer-scaling", "llama-qk-fp32-softmax", "gpt2-wide-heads",
                              "gpt2-uneven-heads", "gpt2-qk-wide-heads", "llama-qk-wide-heads",
                              "llama-mha-uneven-heads", "llama-qk-fp32-softmax-uneven-heads"])
def test_the_activation_formula_is_what_a_real_layer_saves(model, t, sequence_parallel):
    """The analytic count against the bytes a real layer's shard stashes, exact but for the
    CPU's dropout masks and norm statistics (`cpu_layer_bytes`). The core's own stashes are
    compared where the formula's attention path runs: PyTorch's math path in fp32 (taken with
    attention dropout), the CPU's fused flash kernel (without), the unfused attention of the fp32
    softmax in bf16; not bf16 with attention dropout, where the CPU's math path computes the
    core in fp32. Under --sequence-parallel
    the layer is fed its s/t tokens, as in training, and gathers the sequence for its linears
    itself."""
    b = 2
    model = dataclasses.replace(model, sequence_parallel=sequence_parallel)
    with_core = (False, True)
    for dtype, e, checked in (
            (torch.float32, 4, with_core),
            (torch.bfloat16, 2, with_core if unfused_attention(model, 2)
             or model.attention_dropout == 0 else (True,))):
        body = measured_module._piece(model, t, 1, False, False, dtype, torch.device("cpu"))
        layer = next(iter(body.transformer.layers.values()))
        s = model.seq_length
        rotary = None if body.transformer.rotary is None else body.transformer.rotary(s)
        hidden = torch.randn(b, s // model.sequence_ranks(t), model.hidden_size, dtype=dtype,
                             requires_grad=True)
        measured = dict(zip((False, True), saved_activation_bytes(layer, hidden, None, rotary)))
        for selective in checked:
            assert measured[selective] == cpu_layer_bytes(model, t, b, e, selective), \
                (dtype, selective)


def test_the_measured_profile_runs_the_llama_layer_with_its_rotary_tables():
    """Grouped-query attention's narrower QKV output and the rotary tables reach the measured
    pieces (the attention core timed on project_qkv's q, k, v)."""
    records = measure_costs(LLAMA, PrecisionConfig(), [(1, 1), (2, 1)], torch.device("cpu"),
                            repeats=1)
    for t in (1, 2):
        assert records[(t, 1)]["layer_activation_bytes"] == cpu_layer_bytes(LLAMA, t, 1, 4, False)
        assert records[(t, 1)]["attention_core_forward_s"] > 0


@pytest.mark.parametrize("model", [MODEL, LLAMA, ModelConfig(
    model_type="bert", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
    vocab_size=1000, num_tokentypes=2)], ids=["gpt2", "llama", "bert"])
def test_a_sequence_parallel_profile_feeds_each_rank_its_part_of_the_sequence(model):
    """t = 2 with --sequence-parallel: the timed layer and head get [b, s/2, h] and the embedding
    returns it, as in training; every piece runs forward and backward; the layer's stashed bytes
    are the formula's for that split."""
    model = dataclasses.replace(model, sequence_parallel=True)
    cpu, b, t = torch.device("cpu"), 2, 2
    modules = {"body": measured_module._piece(model, t, 1, False, False, torch.float32, cpu),
               "embedding": measured_module._piece(model, t, 0, True, False, torch.float32, cpu),
               "head": measured_module._piece(model, t, 0, False, True, torch.float32, cpu)}
    fed = []
    for piece in ("body", "head"):
        modules[piece].register_forward_pre_hook(
            lambda module, args, piece=piece: fed.append((piece, tuple(args[0].shape))))
    timed, stashed = measured_module._size_pieces(model, modules, b, cpu)
    for name, (fn, setup) in timed.items():
        if setup is not None:
            setup()
        fn()
    half = (b, 16, 64)
    assert set(fed) == {("body", half), ("head", half)}
    embedded = modules["embedding"](None, measured_module._synthetic_batch(model, b, cpu))
    assert tuple(embedded.shape) == half
    if model.model_type == "gpt":
        assert stashed["layer_activation_bytes"] == cpu_layer_bytes(model, t, b, 4, False)
        assert stashed["layer_activation_bytes"] < \
            cpu_layer_bytes(dataclasses.replace(model, sequence_parallel=False), t, b, 4, False)


def test_analytic_sequence_parallel_runs_the_replicated_work_on_part_of_the_sequence():
    """At t = 2 the norms, the row-parallel bias adds, dropouts and residual adds (and the
    embedding's position add and dropout) move half their bytes; nothing changes at t = 1."""
    memory_only = dataclasses.replace(HARDWARE, peak_flops={"float32": 1e30},
                                      kernel_overhead_s=0.0)
    sp = dataclasses.replace(MODEL, sequence_parallel=True)
    b, sbh, e = 2, 2 * 32 * 64, 4
    plain = AnalyticProfile(MODEL, PrecisionConfig(), memory_only)
    split = AnalyticProfile(sp, PrecisionConfig(), memory_only)
    # 2 x (bias 2e, dropout 2e + mask, residual 3e) and 2 LayerNorms (2e), half of it saved
    saved = (2 * (2 * e + 5 * e + MASK_BYTES) + 2 * 2 * e) * sbh / 2 / 0.5e11
    assert plain.costs(2, b).layer_forward_s - split.costs(2, b).layer_forward_s == \
        pytest.approx(saved)
    assert plain.costs(2, b).layer_backward_s - split.costs(2, b).layer_backward_s == \
        pytest.approx(2 * saved)
    # positions (gather, add: 4e) and dropout (2e + mask) on half the tokens; the rows' lookup whole
    assert plain.costs(2, b).embedding_forward_s - split.costs(2, b).embedding_forward_s == \
        pytest.approx((6 * e + MASK_BYTES) * sbh / 2 / 0.5e11)
    assert plain.costs(2, b).head_forward_s == split.costs(2, b).head_forward_s
    assert plain.costs(1, b) == split.costs(1, b)
    assert split.costs(2, b).layer_activation_bytes == layer_activation_bytes(sp, 2, b, e)


def test_measured_profile_is_cached_interpolated_and_scaled(tmp_path, monkeypatch):
    calls = []
    real = measured_module.measure_costs

    def counting(model, precision, sizes, device=None, repeats=7):
        calls.append(list(sizes))
        records = real(model, precision, sizes, device, repeats=1)
        return {key: {**record, "head_forward_s": float(len(calls))}  # which call measured it
                for key, record in records.items()}

    monkeypatch.setattr(measured_module, "measure_costs", counting)
    profile = measured_profile(MODEL, PrecisionConfig(), HARDWARE, [1, 2], tmp_path,
                               tensor_parallel_sizes=[2], rounds=3)
    # t = 1 always (other t fall back on it); every size in every round's one pass
    assert calls == [[(1, 1), (1, 2), (2, 1), (2, 2)]] * 3
    [cache] = tmp_path.glob("toy__gpt-h64-a4-f256-s32-v1024-dropout0.1-0.1__float32.json")
    stored = json.loads(cache.read_text())["tensor_parallel"]
    assert set(stored) == {"1", "2"} and set(stored["1"]) == {"1", "2"}
    assert stored["1"]["2"]["head_forward_s"] == 2.0  # the median of rounds 1, 2 and 3
    assert stored["1"]["1"]["layer_activation_bytes"] > 0
    # one rank's shard stashes less than the whole layer (the replicated LayerNorm inputs stay)
    assert 0 < stored["2"]["2"]["layer_activation_bytes"] < stored["1"]["2"]["layer_activation_bytes"]
    again = measured_profile(MODEL, PrecisionConfig(), HARDWARE, [2, 1], tmp_path,
                             tensor_parallel_sizes=[2])
    assert len(calls) == 3  # nothing measured again
    assert again.records == profile.records
    assert again.costs(2, 2).layer_forward_s == stored["2"]["2"]["layer_forward_s"]

    keys = stored["1"]["1"]
    records = {(1, 1): dict.fromkeys(keys, 1.0), (1, 3): dict.fromkeys(keys, 2.0)}
    fake = MeasuredProfile(records, AnalyticProfile(MODEL, PrecisionConfig(), HARDWARE))
    assert fake.costs(1, 5).layer_forward_s == pytest.approx(3.0)  # the line through b = 1, 3
    analytic = AnalyticProfile(MODEL, PrecisionConfig(), HARDWARE)
    ratio = analytic.costs(2, 1).layer_forward_s / analytic.costs(1, 1).layer_forward_s
    assert fake.costs(2, 1).layer_forward_s == pytest.approx(ratio)  # t = 2 not measured: scaled


def test_sizes_are_interleaved_run_by_run_after_a_warm_up_run(monkeypatch):
    """Each piece runs once at every size before its next run at any: the machine's drift moves
    all sizes alike, so the ratios between sizes stay steady."""
    log = []
    names = ("layer_forward_s", "head_forward_s")

    def logging_pieces(model, modules, b, device):
        timed = {name: (lambda name=name, b=b: log.append((name, b)), None) for name in names}
        return timed, {"layer_activation_bytes": float(b)}

    clock = iter(range(1000))  # the k-th timed call takes k seconds
    monkeypatch.setattr(measured_module, "_size_pieces", logging_pieces)
    monkeypatch.setattr(measured_module, "timed_call",
                        lambda fn, device, setup=None: (fn(), float(next(clock)))[1])
    records = measured_module.measure_costs(MODEL, PrecisionConfig(), [(1, 1), (1, 2)],
                                           torch.device("cpu"), repeats=3)
    assert log == [(name, b) for _ in range(4) for name in names for b in (1, 2)]
    # calls 0-3 warm up; the layer's forward at b = 1 is calls 4, 8 and 12, the head's at b = 2
    # calls 7, 11 and 15
    assert records[(1, 1)]["layer_forward_s"] == 8.0 and records[(1, 2)]["head_forward_s"] == 11.0
    assert records[(1, 2)]["layer_activation_bytes"] == 2.0


def test_as_many_processes_profile_at_once_as_the_job_keeps_cores_busy():
    assert profiling_processes(HARDWARE, 8) == 1  # a device per rank: nothing shared
    cpu = dataclasses.replace(HARDWARE, devices_per_node=4, compute_slots_per_node=2)
    assert profiling_processes(cpu, 4) == 2  # 4 ranks, 2 cores: 2 compute at once
    assert profiling_processes(cpu, 1) == 1
    assert profiling_processes(dataclasses.replace(cpu, compute_slots_per_node=8), 16) == 4


def test_profiling_at_once_runs_in_forked_copies_and_takes_the_median(monkeypatch):
    parent = os.getpid()

    def which_process(model, precision, sizes, device=None, repeats=7):
        return {(t, b): {"layer_forward_s": float(os.getpid()), "head_forward_s": float(b)}
                for t, b in sizes}

    monkeypatch.setattr(measured_module, "measure_costs", which_process)
    here = measure_costs_at_once(MODEL, PrecisionConfig(), [(1, 2)], processes=1)
    assert here == {(1, 2): {"layer_forward_s": float(parent), "head_forward_s": 2.0}}
    at_once = measure_costs_at_once(MODEL, PrecisionConfig(), [(1, 2), (2, 4)], processes=3)
    assert set(at_once) == {(1, 2), (2, 4)}
    assert at_once[(2, 4)]["head_forward_s"] == 4.0
    # the median of three other processes' ids: the middle child's, not this process's
    assert at_once[(1, 2)]["layer_forward_s"] not in (float(parent), 0.0)
    copies = measure_costs_per_copy(MODEL, PrecisionConfig(), [(1, 2)], processes=3)[(1, 2)]
    assert len({copy["layer_forward_s"] for copy in copies}) == 3  # three processes
    assert float(parent) not in {copy["layer_forward_s"] for copy in copies}

    def failing(*args, **kwargs):
        raise ValueError("no memory for this micro batch")

    monkeypatch.setattr(measured_module, "measure_costs", failing)
    with pytest.raises(RuntimeError, match="(?s)profiling in 2 processes failed.*no memory"):
        measure_costs_at_once(MODEL, PrecisionConfig(), [(1, 2)], processes=2)


def test_a_profile_measured_at_once_is_cached_apart(tmp_path, monkeypatch):
    names = ("layer_forward_s", "layer_backward_s", "attention_core_forward_s",
             "embedding_forward_s", "embedding_backward_s", "head_forward_s", "head_backward_s",
             "layer_activation_bytes", "selective_layer_activation_bytes")
    monkeypatch.setattr(measured_module, "measure_costs",
                        lambda model, precision, sizes, device=None, repeats=7:
                        {key: dict.fromkeys(names, 1.0) for key in sizes})
    measured_profile(MODEL, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1, processes=2)
    assert [p.name for p in tmp_path.glob("*.json")] == \
        ["toy__gpt-h64-a4-f256-s32-v1024-dropout0.1-0.1__float32__x2.json"]


def test_a_cached_profile_serves_only_the_same_model_and_torch(tmp_path, monkeypatch):
    calls = []

    def constant(model, precision, sizes, device=None, repeats=7):
        calls.append(model.hidden_dropout)
        return {key: {"layer_forward_s": 1.0} for key in sizes}

    monkeypatch.setattr(measured_module, "measure_costs", constant)
    measured_profile(MODEL, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    measured_profile(MODEL, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    assert calls == [0.1]  # the second time from the cache
    # without dropout a CPU layer runs about twice as fast: its own file, measured again
    no_dropout = dataclasses.replace(MODEL, hidden_dropout=0.0, attention_dropout=0.0)
    measured_profile(no_dropout, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    assert calls == [0.1, 0.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "toy__gpt-h64-a4-f256-s32-v1024-dropout0-0__float32.json",
        "toy__gpt-h64-a4-f256-s32-v1024-dropout0.1-0.1__float32.json"]  # no temporary left
    cache = tmp_path / "toy__gpt-h64-a4-f256-s32-v1024-dropout0.1-0.1__float32.json"
    stored = json.loads(cache.read_text())
    assert stored["model"]["hidden_dropout"] == 0.1 and stored["torch"] == torch.__version__
    # measured by another torch, or not JSON at all: measured again and replaced
    cache.write_text(json.dumps({**stored, "torch": "1.13.0"}))
    measured_profile(MODEL, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    assert calls == [0.1, 0.0, 0.1] and json.loads(cache.read_text())["torch"] == torch.__version__
    cache.write_text('{"tensor_parallel": {"1": {"1": {"layer_forw')
    profile = measured_profile(MODEL, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    assert calls == [0.1, 0.0, 0.1, 0.1] and profile.records[1][1] == {"layer_forward_s": 1.0}


@pytest.mark.parametrize("switches, name", [
    ({"normalization": "RMSNorm"}, "-RMSNorm"),
    ({"add_bias_linear": False}, "-nobias-noqkvbias"),
    ({"add_bias_linear": False, "add_qkv_bias": True}, "-nobias"),
    ({"swiglu": True, "ffn_hidden_size": 256}, "-swiglu"),  # the same ffn size
    ({"position_embedding_type": "rope"}, "-posrope"),
    ({"position_embedding_type": "rope", "rotary_percent": 0.5}, "-posrope-rot0.5"),
    ({"position_embedding_type": "rope", "rotary_interleaved": True}, "-posrope-interleaved"),
    ({"position_embedding_type": "none"}, "-posnone"),
    ({"num_query_groups": 2}, "-g2"),
    ({"num_query_groups": 4}, None),  # one group per head: GPT-2's attention
    ({"kv_channels": 32}, "-kv32"),  # heads of 32, not h / a
    ({"kv_channels": 16}, None),  # h / a: GPT-2's attention
    ({"num_attention_heads": 6, "kv_channels": 16}, "-kv16"),  # h / a rounds down to 10
    ({"num_query_groups": 2, "kv_channels": 32, "qk_layernorm": True}, "-g2-kv32-qknorm"),
    ({"untie_embeddings_and_output_weights": True}, None),  # the same shapes, the same times
    ({"qk_layernorm": True}, "-qknorm"),
    ({"apply_layernorm_1p": True}, "-norm1p"),
    ({"attention_softmax_in_fp32": True}, None),  # fp32: scaled_dot_product_attention as before
    ({"apply_query_key_layer_scaling": True}, None),
])
def test_a_cached_profile_serves_only_the_same_architecture(tmp_path, monkeypatch, switches, name):
    calls = []
    monkeypatch.setattr(measured_module, "measure_costs",
                        lambda model, precision, sizes, device=None, repeats=7:
                        calls.append(model) or {key: {"layer_forward_s": 1.0} for key in sizes})
    measured_profile(MODEL, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    other = dataclasses.replace(MODEL, **switches)
    measured_profile(other, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    files = sorted(p.name for p in tmp_path.iterdir())
    if name is None:  # served from GPT-2's cache
        assert calls == [MODEL] and len(files) == 1
        return
    assert calls == [MODEL, other]
    f, a = switches.get("ffn_hidden_size", 256), other.num_attention_heads
    assert f"toy__gpt-h64-a{a}-f{f}-s32-v1024{name}-dropout0.1-0.1__float32.json" in files
    assert measured_module._profile_identity(other) != measured_module._profile_identity(MODEL)
    measured_profile(other, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    assert len(calls) == 2  # its own file serves it next time


def test_the_fp32_softmax_has_its_own_profile_under_half_precision(
        tmp_path, monkeypatch, reduced_precision_math_attention):
    """bf16: the unfused attention is measured apart from SDPA's; layer scaling, which implies the
    fp32 softmax and runs the same kernels (the measured layer is the first: coefficient 1),
    shares its file."""
    calls = []
    monkeypatch.setattr(measured_module, "measure_costs",
                        lambda model, precision, sizes, device=None, repeats=7:
                        calls.append(model) or {key: {"layer_forward_s": 1.0} for key in sizes})
    bf16 = PrecisionConfig(bf16=True)
    fp32_softmax = dataclasses.replace(MODEL, attention_softmax_in_fp32=True)
    for model in (MODEL, fp32_softmax, dataclasses.replace(MODEL,
                                                           apply_query_key_layer_scaling=True)):
        measured_profile(model, bf16, HARDWARE, [1], tmp_path, rounds=1)
    assert calls == [MODEL, fp32_softmax]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "toy__gpt-h64-a4-f256-s32-v1024-dropout0.1-0.1__bfloat16.json",
        "toy__gpt-h64-a4-f256-s32-v1024-fp32softmax-dropout0.1-0.1__bfloat16.json"]


def test_sequence_parallel_is_in_the_cache_identity_when_a_t_above_1_is_measured(tmp_path,
                                                                                 monkeypatch):
    """--sequence-parallel changes what a t > 1 shard is fed, not t = 1: a profile of t = 1 alone
    is the plain model's (its file, measured without the flag); with t = 2 it has its own file."""
    calls = []
    monkeypatch.setattr(measured_module, "measure_costs",
                        lambda model, precision, sizes, device=None, repeats=7:
                        calls.append((model.sequence_parallel, list(sizes)))
                        or {key: {"layer_forward_s": 1.0} for key in sizes})
    sp = dataclasses.replace(MODEL, sequence_parallel=True)
    measured_profile(MODEL, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    measured_profile(sp, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1)
    assert calls == [(False, [(1, 1)])]  # served by the plain model's file
    measured_profile(sp, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1,
                     tensor_parallel_sizes=[2])
    assert calls[1:] == [(True, [(1, 1), (2, 1)])]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "toy__gpt-h64-a4-f256-s32-v1024-dropout0.1-0.1__float32.json",
        "toy__gpt-h64-a4-f256-s32-v1024-sp-dropout0.1-0.1__float32.json"]
    assert measured_module._profile_identity(sp) == \
        measured_module._profile_identity(MODEL) | {"sequence_parallel": True}
    again = measured_profile(sp, PrecisionConfig(), HARDWARE, [1], tmp_path, rounds=1,
                             tensor_parallel_sizes=[2])
    assert len(calls) == 2 and again.analytic.model.sequence_parallel


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_copies_forked_by_a_rank_bound_to_one_core_spread_over_the_node(monkeypatch):
    monkeypatch.setattr(measured_module, "measure_costs",
                        lambda model, precision, sizes, device=None, repeats=7:
                        {key: {"cores": float(len(os.sched_getaffinity(0)))} for key in sizes})
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})  # as --bind-cores-to-rank leaves rank 0
    try:
        measured = measure_costs_at_once(MODEL, PrecisionConfig(), [(1, 2)], processes=2)
    finally:
        os.sched_setaffinity(0, mine)
    assert measured[(1, 2)]["cores"] == float(len(mine))


def test_turn_taking_is_measured_where_a_job_puts_more_ranks_than_processors_on_a_node():
    assert turn_taking_processors(HARDWARE, 8) == 0  # a device per rank
    cpu = dataclasses.replace(HARDWARE, devices_per_node=4, compute_slots_per_node=2)
    assert turn_taking_processors(cpu, 4) == 2  # 4 ranks take turns on 2 cores
    assert turn_taking_processors(cpu, 2) == 0  # a core each


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_turn_taking_compares_two_copies_per_core_with_one(monkeypatch):
    """Each copy is bound to a single core and reports its processor seconds: one copy per core,
    then two, and the overhead is the ratio less 1 (here a fake copy's figure is the number of
    copies running at once, so two per core read as 100% more; an unbound copy would report its
    square, 300% more)."""
    def copies_at_once(model, precision, sizes, start, seconds):
        start.wait()
        bound = len(os.sched_getaffinity(0)) == 1
        return {key: float(start.parties) ** (1 if bound else 2) for key in sizes}

    monkeypatch.setattr(measured_module, "_layer_processor_seconds", copies_at_once)
    overheads = measure_turn_taking(MODEL, PrecisionConfig(), [(1, 2), (2, 4)], processors=1,
                                    rounds=2)
    assert overheads == {(1, 2): pytest.approx(1.0), (2, 4): pytest.approx(1.0)}
    with pytest.raises(ValueError, match="1000 processors asked for"):
        measure_turn_taking(MODEL, PrecisionConfig(), [(1, 2)], processors=1000)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_turn_taking_times_the_real_layer():
    overheads = measure_turn_taking(MODEL, PrecisionConfig(), [(1, 2), (2, 2)], processors=1,
                                    rounds=1, seconds=0.05)
    assert set(overheads) == {(1, 2), (2, 2)}
    assert all(value >= 0.0 and math.isfinite(value) for value in overheads.values())
    # what each copy reports: its own processor seconds per forward and backward of the layer
    alone = measured_module._layer_processor_seconds(MODEL, PrecisionConfig(), [(1, 2)],
                                                    threading.Barrier(1), 0.05)
    assert alone[(1, 2)] > 0.0 and math.isfinite(alone[(1, 2)])


def test_a_profile_measures_turn_taking_once_and_caches_it(tmp_path, monkeypatch):
    names = ("layer_forward_s", "layer_backward_s", "attention_core_forward_s",
             "embedding_forward_s", "embedding_backward_s", "head_forward_s", "head_backward_s",
             "layer_activation_bytes", "selective_layer_activation_bytes")
    pieces, turns = [], []
    monkeypatch.setattr(measured_module, "measure_costs",
                        lambda model, precision, sizes, device=None, repeats=7:
                        pieces.append(sizes) or {key: dict.fromkeys(names, 1.0) for key in sizes})
    monkeypatch.setattr(measured_module, "measure_turn_taking",
                        lambda model, precision, sizes, processors:
                        turns.append((sizes, processors)) or
                        {(t, b): 0.1 * b for t, b in sizes})
    cpu = dataclasses.replace(HARDWARE, devices_per_node=4, compute_slots_per_node=2)
    alone = measured_profile(MODEL, PrecisionConfig(), cpu, [1, 2], tmp_path, rounds=1)
    assert alone.costs(1, 2).turn_taking_overhead == 0.0 and not turns  # nothing measured: none
    taking = measured_profile(MODEL, PrecisionConfig(), cpu, [1, 2], tmp_path, rounds=1,
                              turn_taking_processors=2)
    assert len(pieces) == 1  # the pieces came from the cache; only the turns were measured
    assert turns == [([(1, 1), (1, 2)], 2)]
    assert taking.costs(1, 2).turn_taking_overhead == pytest.approx(0.2)
    again = measured_profile(MODEL, PrecisionConfig(), cpu, [1, 2], tmp_path, rounds=1,
                             turn_taking_processors=2)
    assert len(turns) == 1 and again.costs(1, 1).turn_taking_overhead == pytest.approx(0.1)


def test_analytic_efficiency_rises_with_micro_batch_and_hidden_size_on_an_h100():
    """On the roofline a layer's achieved FLOP/s rises with the micro batch (more rows per GEMM,
    launches amortised) and with the hidden size (higher arithmetic intensity), below the
    attainable peak, as measured GPUs behave; not a constant fraction of the peak."""
    hardware = load_hardware("h100-sxm-1gpu")
    bf16 = PrecisionConfig(bf16=True)
    attainable = hardware.flops_for("bfloat16") * hardware.efficiency

    def efficiency(hidden: int, micro: int, seq: int = 512) -> float:
        model = ModelConfig(num_layers=24, hidden_size=hidden, num_attention_heads=hidden // 64,
                            seq_length=seq, vocab_size=50257)
        costs = AnalyticProfile(model, bf16, hardware).costs(1, micro)
        flops = 3 * micro * seq * (linear_flops_per_token(model) + attention_flops_per_token(model))
        return flops / (costs.layer_forward_s + costs.layer_backward_s) / attainable

    for hidden in (768, 2048):
        by_micro = [efficiency(hidden, b) for b in (1, 2, 4, 8, 16)]
        assert by_micro == sorted(by_micro) and by_micro[0] < by_micro[-1] < 1.0, by_micro
    for micro in (1, 8):
        by_hidden = [efficiency(h, micro) for h in (256, 768, 2048, 4096)]
        assert by_hidden == sorted(by_hidden) and by_hidden[-1] > 1.5 * by_hidden[0], by_hidden
    # a narrow, few-row GEMM is bound by its operands' bytes, a wide one by its FLOPs
    profile = AnalyticProfile(ModelConfig(num_layers=1, hidden_size=4096, num_attention_heads=32,
                                          seq_length=1, vocab_size=8), bf16, hardware)
    [(flops, moved, _)] = gemm(1, 4096, 4096, 2).gemms
    assert profile.seconds(gemm(1, 4096, 4096, 2)) == pytest.approx(
        moved / (hardware.memory_bandwidth * hardware.efficiency) + hardware.kernel_overhead_s)
    [(flops, moved, _)] = gemm(8192, 4096, 4096, 2).gemms
    assert profile.seconds(gemm(8192, 4096, 4096, 2)) == pytest.approx(
        flops / attainable + hardware.kernel_overhead_s)


def test_analytic_fused_attention_moves_no_scores_on_cuda():
    """On CUDA the fused kernel's traffic is q, k, v and the output (e each per token and
    channel of the attention's width) and a log-sum-exp per row: linear in s, where the math
    path's scores grow with s^2; its stash is the formula's with the fused core."""
    cuda = dataclasses.replace(HARDWARE, device_type="cuda")
    b, e, t = 2, 4, 2
    for model in (MODEL, dataclasses.replace(MODEL, seq_length=2 * MODEL.seq_length)):
        core = AnalyticProfile(model, PrecisionConfig(), cuda).attention_core(t, b)
        sb, width = model.seq_length * b, model.attention_size
        assert (core.bytes, core.kernels) == (4 * e * sb * width / t
                                              + 4 * model.num_attention_heads * sb / t, 1)
        # GPT's causal kernel computes the scores on and below the diagonal: half the square
        assert core.flops == 0.0
        assert core.attention_flops == sb * attention_flops_per_token(model) / t / 2
        costs = AnalyticProfile(model, PrecisionConfig(), cuda).costs(t, b)
        assert costs.layer_activation_bytes == planner_memory.layer_activation_bytes(
            model, t, b, e, device_type="cuda")
        math = AnalyticProfile(model, PrecisionConfig(), HARDWARE).attention_core(t, b)
        assert math.bytes > core.bytes and math.flops == 2 * core.attention_flops


def test_fused_attention_runs_at_its_measured_rate_and_gemms_at_theirs():
    """With measured rates in the hardware file: the fused attention kernel's FLOPs at
    attention_efficiency of peak, BERT's (not causal) the whole square; each GEMM at the share
    measured for its size, interpolated in log n between the measured square sizes."""
    cuda = dataclasses.replace(HARDWARE, device_type="cuda", attention_efficiency=0.25,
                               matmul_efficiency=((1024, 0.2), (4096, 0.8)))
    b, t = 2, 1
    bert = dataclasses.replace(MODEL, model_type="bert")
    for model, share in ((MODEL, 0.5), (bert, 1.0)):
        profile = AnalyticProfile(model, PrecisionConfig(), cuda)
        core = profile.attention_core(t, b)
        flops = model.seq_length * b * attention_flops_per_token(model) / t * share
        assert core.attention_flops == flops
        assert profile.seconds(core) == pytest.approx(
            flops / (0.25 * 1e12) + core.bytes / (1e11 * 0.5))
    assert cuda.gemm_efficiency(2 * 512 ** 3) == 0.2 and cuda.gemm_efficiency(2 * 8192 ** 3) == 0.8
    assert cuda.gemm_efficiency(2 * 2048 ** 3) == pytest.approx(0.5)  # halfway in log n
    assert HARDWARE.gemm_efficiency(2 * 2048 ** 3) == HARDWARE.efficiency  # nothing measured
    profile = AnalyticProfile(MODEL, PrecisionConfig(), cuda)
    square = gemm(2048, 2048, 2048, 4)
    [(flops, _, _)] = square.gemms
    assert profile.seconds(square) == pytest.approx(flops / (0.5 * 1e12))
    assert profile.seconds(square * 3) == pytest.approx(3 * flops / (0.5 * 1e12))
