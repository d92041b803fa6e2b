import dataclasses

import pytest
import torch

from megatron_2bw.config import ModelConfig, ParallelConfig, PrecisionConfig, RecomputeConfig
from megatron_2bw.distributed.comm import ShardShapeGroup
from megatron_2bw.models import MODELS
from megatron_2bw.planner import memory as planner_memory
from megatron_2bw.planner.memory import (layer_parameters, qkv_stash_bytes,
                                         stage_parameter_tensors, stage_parameters,
                                         stage_tensor_partial_grad_parameters)


# The counts below are those of the CPU's attention kernels, which the CPU tests can measure:
# PyTorch's math attention (it keeps the scores) wherever the model has attention dropout.
def layer_activation_bytes(*args, **kwargs) -> float:
    return planner_memory.layer_activation_bytes(*args, device_type="cpu", **kwargs)


def attention_core_bytes(*args, **kwargs) -> float:
    return planner_memory.attention_core_bytes(*args, device_type="cpu", **kwargs)


def estimate_stage_memory(*args, **kwargs) -> planner_memory.StageMemory:
    return planner_memory.estimate_stage_memory(*args, device_type="cpu", **kwargs)


MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=1000)  # vocabulary padded to 1024
H, S, A, F, V = 64, 32, 4, 256, 1024
LAYER = 12 * H * H + 13 * H  # QKV, dense, fc1, fc2 weights and biases, two LayerNorms
EMBEDDING = V * H + S * H  # word + learned positions
HEAD = 2 * H + V * H  # final LayerNorm + the last stage's copy of the tied word embeddings
# Llama's layout (Megatron-LM's flags): RMSNorm, no linear biases, SwiGLU, rotary positions,
# 2 query groups (of 2 heads here), an untied output layer
LLAMA_SWITCHES = dict(normalization="RMSNorm", add_bias_linear=False, swiglu=True,
                      position_embedding_type="rope", num_query_groups=2,
                      untie_embeddings_and_output_weights=True)
LLAMA_F = 128  # SwiGLU's default ffn: int(4h * 2/3 / 64) * 64
LLAMA = dataclasses.replace(MODEL, ffn_hidden_size=LLAMA_F, **LLAMA_SWITCHES)
# QKV 2h x h (4 query heads + 2 keys + 2 values of 16), dense, fc1 (gate and up), fc2: no biases
LLAMA_WEIGHTS = (2 * H + H + 2 * LLAMA_F + LLAMA_F) * H
MODEL_SP = dataclasses.replace(MODEL, sequence_parallel=True)  # --sequence-parallel
LLAMA_SP = dataclasses.replace(LLAMA, sequence_parallel=True)
# --qk-layernorm (with --apply-layernorm-1p: the same parameters, zero-centred)
MODEL_QK = dataclasses.replace(MODEL, qk_layernorm=True, apply_layernorm_1p=True)
LLAMA_QK_SP = dataclasses.replace(LLAMA_SP, qk_layernorm=True)
# --kv-channels: heads wider than h/a (4 of 32: the attention 2h wide), and heads that do not
# divide the hidden size (6 of 16: 1.5h wide; Llama's in 2 groups of 3)
WIDE_HEADS = dataclasses.replace(MODEL, kv_channels=2 * H // A)
UNEVEN_HEADS = dataclasses.replace(MODEL, num_attention_heads=6, kv_channels=H // A)
LLAMA_QK_SP_WIDE_HEADS = dataclasses.replace(LLAMA_QK_SP, kv_channels=2 * H // A)
LLAMA_SP_UNEVEN_HEADS = dataclasses.replace(LLAMA_SP, num_attention_heads=6, kv_channels=H // A)


def test_parameter_counts_follow_the_model_code():
    assert layer_parameters(MODEL, 1) == LAYER
    # t = 2: weights and column-parallel biases split, row-parallel biases and norms replicated
    assert layer_parameters(MODEL, 2) == (12 * H * H + 7 * H) // 2 + 6 * H
    assert stage_parameters(MODEL, 1, 2, True, False) == EMBEDDING + 2 * LAYER
    assert stage_parameters(MODEL, 1, 2, False, True) == 2 * LAYER + HEAD
    assert stage_parameters(MODEL, 1, 4, True, True) == EMBEDDING + 4 * LAYER + 2 * H  # tied once
    assert stage_parameters(MODEL, 2, 0, True, False) == V * H // 2 + S * H  # positions replicated
    untied = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         vocab_size=1000, untie_embeddings_and_output_weights=True)
    assert stage_parameters(untied, 1, 4, True, True) == EMBEDDING + 4 * LAYER + HEAD  # its own
    assert stage_parameters(untied, 1, 2, False, True) == 2 * LAYER + HEAD
    bert = ModelConfig(model_type="bert", num_layers=2, hidden_size=64, num_attention_heads=4,
                       seq_length=32, vocab_size=1000, num_tokentypes=2)
    # final norm, LM transform, LM norm, LM bias, pooler, sentence-order head, tied embedding copy
    heads = 2 * H + (H * H + H) + 2 * H + V + (H * H + H) + (2 * H + 2) + V * H
    assert stage_parameters(bert, 1, 0, False, True) == heads


@pytest.mark.parametrize("t", [1, 2])
def test_llama_parameter_counts(t):
    """Two RMSNorm weights per layer, no biases, no position table, the untied output layer."""
    assert layer_parameters(LLAMA, t) == LLAMA_WEIGHTS // t + 2 * H
    assert stage_parameters(LLAMA, t, 2, True, False) == V * H // t + 2 * layer_parameters(LLAMA, t)
    assert stage_parameters(LLAMA, t, 0, False, True) == H + V * H // t  # final norm, output layer
    assert stage_parameter_tensors(LLAMA, t, 1, False, False) == 6  # 4 weights, 2 norm weights
    qkv_bias = dataclasses.replace(LLAMA, add_qkv_bias=True)  # the qkv projection keeps its bias
    assert layer_parameters(qkv_bias, t) == layer_parameters(LLAMA, t) + 2 * H // t
    assert stage_parameter_tensors(qkv_bias, t, 1, False, False) == 7


@pytest.mark.parametrize("t", [1, 2])
def test_parameter_counts_follow_the_head_size(t):
    """QKV maps h to 3w features, w = heads x head size, and the dense projection w back to h
    (weights and column-parallel biases split over t; row-parallel biases and norms replicated)."""
    for model, width in ((WIDE_HEADS, 2 * H), (UNEVEN_HEADS, 6 * H // A)):
        split = (3 * width + width) * H + 3 * width + (2 * H * F + F)
        assert layer_parameters(model, t) == split // t + 2 * H + 4 * H


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("model", [MODEL, LLAMA, MODEL_SP, LLAMA_SP, MODEL_QK, LLAMA_QK_SP,
                                   WIDE_HEADS, UNEVEN_HEADS, LLAMA_QK_SP_WIDE_HEADS,
                                   LLAMA_SP_UNEVEN_HEADS],
                         ids=["gpt2", "llama", "gpt2-sp", "llama-sp", "gpt2-qk", "llama-qk-sp",
                              "gpt2-wide-heads", "gpt2-uneven-heads", "llama-qk-sp-wide-heads",
                              "llama-sp-uneven-heads"])
@pytest.mark.parametrize("layers, first, last", [(2, True, False), (2, False, True),
                                                 (4, True, True), (1, False, False)])
def test_stage_parameters_equal_the_built_stage(model, t, layers, first, last):
    """What one rank of the stage holds, built with t's shard shapes (and, under
    --sequence-parallel, which of them have their gradients summed over the tensor group)."""
    with torch.device("meta"):
        stage = MODELS[model.model_type](model, ShardShapeGroup(t) if t > 1 else None,
                                         model.padded_vocab_size(t), range(layers), first, last)
    assert stage_parameters(model, t, layers, first, last) == \
        sum(p.numel() for p in stage.parameters())
    assert stage_parameter_tensors(model, t, layers, first, last) == len(list(stage.parameters()))
    assert stage_tensor_partial_grad_parameters(model, t, layers, first, last) == \
        sum(p.numel() for p in stage.parameters() if p.spec.tensor_partial_grad)


def test_sequence_parallel_parameters_are_the_replicated_ones_used_on_part_of_the_sequence():
    """Two LayerNorms and the two row-parallel biases per layer, the position table; the final
    norm runs on the gathered sequence. Llama: the two RMSNorm weights. None at t = 1."""
    assert stage_tensor_partial_grad_parameters(MODEL_SP, 2, 1, False, False) == 6 * H
    assert stage_tensor_partial_grad_parameters(MODEL_SP, 2, 2, True, False) == 12 * H + S * H
    assert stage_tensor_partial_grad_parameters(MODEL_SP, 2, 2, False, True) == 12 * H
    assert stage_tensor_partial_grad_parameters(LLAMA_SP, 2, 2, True, True) == 4 * H
    assert stage_tensor_partial_grad_parameters(MODEL_SP, 1, 4, True, True) == 0
    assert stage_tensor_partial_grad_parameters(MODEL, 2, 4, True, True) == 0


def test_qk_layernorm_parameters_are_replicated_and_summed_over_the_tensor_group():
    """Two norms over the head size per layer (LayerNorm: weight and bias), replicated; each rank
    applies them to its own heads, so at t = 2 their gradients are summed, with or without
    --sequence-parallel."""
    D = H // A
    for t in (1, 2):
        assert layer_parameters(MODEL_QK, t) == layer_parameters(MODEL, t) + 4 * D
    assert stage_tensor_partial_grad_parameters(MODEL_QK, 2, 2, False, False) == 2 * 4 * D
    assert stage_tensor_partial_grad_parameters(MODEL_QK, 1, 2, False, False) == 0
    assert stage_tensor_partial_grad_parameters(LLAMA_QK_SP, 2, 1, False, False) == 2 * H + 2 * D


def test_activation_formula_is_korthikantis_count():
    """With attention dropout the CPU runs PyTorch's math attention, which keeps the scores."""
    sbh = S * 1 * H
    # sbh (34 + 5 a s / h) with 2-byte activations, t = 1
    assert layer_activation_bytes(MODEL, 1, 1, 2) == sbh * 34 + 5 * A * S * S
    # sbh (10 + 24/t + 5 a s / (h t)) for t = 2
    assert layer_activation_bytes(MODEL, 2, 1, 2) == \
        sbh * (10 + 12) + 5 * A * S * S / 2
    assert layer_activation_bytes(MODEL, 1, 3, 2, selective=True) == 3 * sbh * 34
    assert layer_activation_bytes(MODEL, 1, 1, 4) == \
        sbh * (16 * 4 + 2) + 9 * A * S * S


def test_fused_attention_keeps_a_row_statistic_instead_of_the_scores():
    """CUDA's fused kernels (and the CPU's flash kernel, without dropout) keep an fp32
    log-sum-exp per row and head: Korthikanti's 34 sbh without the 5as^2b term, as Megatron-LM
    counts its flash-attention layers."""
    sbh, rows = S * 1 * H, A * S
    cuda = planner_memory.layer_activation_bytes  # device_type="cuda"
    assert cuda(MODEL, 1, 1, 2) == sbh * 34 + 4 * rows
    assert cuda(MODEL, 2, 1, 2) == sbh * (10 + 12) + 4 * rows / 2
    no_dropout = dataclasses.replace(MODEL, attention_dropout=0.0)
    assert layer_activation_bytes(no_dropout, 1, 1, 2) == sbh * 34 + 4 * rows  # on the CPU
    bert = dataclasses.replace(MODEL, model_type="bert", num_tokentypes=2)
    # and the float mask SDPA makes of BERT's boolean padding mask
    assert planner_memory.attention_core_bytes(bert, 1, 3, 2) == 4 * 3 * rows + 2 * 3 * S


@pytest.mark.parametrize("t", [1, 2])
def test_activation_formula_follows_the_head_size(t):
    """Korthikanti's count with the attention w = heads x head size wide: Q, K, V and the dense
    input (4e per w/t) and every head's scores; the norms, the QKV and fc1 inputs, the masks (10
    sbh) and the MLP (16 sbh / t) stay h-wide. Selective recomputation drops the scores only (q,
    k and v are views of the QKV output, 3w)."""
    sbh = S * H
    for model, width, heads in ((WIDE_HEADS, 2 * H, A), (UNEVEN_HEADS, 6 * H // A, 6)):
        kept = 10 * sbh + (4 * 2 * S * width + 16 * sbh) / t
        assert layer_activation_bytes(model, t, 1, 2) == kept + 5 * heads * S * S / t
        assert layer_activation_bytes(model, t, 1, 2, selective=True) == kept


def test_activation_formula_follows_the_llama_switches():
    sbh, f = S * H, LLAMA_F
    tables = 2 * 4 * S * 16  # rotary cos and sin, fp32, 16 rotated channels
    # RMSNorm keeps its input in fp32 and the normalised value (4 + e each, two norms); QKV and
    # fc1 inputs, 2 dropout masks; Q, K, V and the dense input (4e / t); SwiGLU's gate/up (2f),
    # silu and product (f each) (4e f / t); the core's scores as before
    replicated = (2 * (4 + 2) + 2 * 2 + 2) * sbh + tables
    assert layer_activation_bytes(LLAMA, 1, 1, 2) == \
        replicated + 4 * 2 * sbh + 4 * 2 * S * f + 5 * A * S * S
    assert layer_activation_bytes(LLAMA, 2, 1, 2) == \
        replicated + (4 * 2 * sbh + 4 * 2 * S * f + 5 * A * S * S) / 2
    # selective: the core's inputs: q, k, v copies (rotated, repeated to every head: h/t each)
    assert layer_activation_bytes(LLAMA, 1, 1, 2, selective=True) == \
        replicated + 4 * 2 * sbh + 4 * 2 * S * f


def test_sequence_parallel_divides_the_replicated_stashes():
    """--sequence-parallel on t = 2: the norms' stashes, the dropout masks and the QKV and fc1
    inputs (the linears keep their part of the sequence and gather it again in the backward) hold
    s/2 tokens, so the replicated 10 sbh of GPT-2's 2-byte count become 10/2; t = 1 is
    unchanged."""
    sbh = S * H
    assert layer_activation_bytes(MODEL_SP, 2, 1, 2) == sbh * (10 / 2 + 12) + 5 * A * S * S / 2
    assert layer_activation_bytes(MODEL_SP, 2, 1, 2, selective=True) == sbh * (10 / 2 + 12)
    assert layer_activation_bytes(MODEL_SP, 1, 1, 2) == layer_activation_bytes(MODEL, 1, 1, 2)
    tables = 2 * 4 * S * 16  # rotary tables: the whole sequence
    assert layer_activation_bytes(LLAMA_SP, 2, 1, 2) == (2 * 6 + 2 + 2 * 2) / 2 * sbh + \
        tables + (4 * 2 * sbh + 4 * 2 * S * LLAMA_F + 5 * A * S * S) / 2


def sequence_parallel_memory(sequence_parallel: bool, stage: int, recompute=None):
    return estimate_stage_memory(
        MODEL_SP if sequence_parallel else MODEL,
        ParallelConfig(tensor_parallel=2, pipeline_parallel=2, schedule="2bw"),
        PrecisionConfig(fp16=True), recompute or RecomputeConfig(), "adam", 1, 4, 1, stage, 1000.0)


def test_sequence_parallel_stages_hold_their_part_of_the_sequence():
    """The first stage's embedding-dropout mask and its output (the pipeline message) hold s/2
    tokens, as do the inputs full recomputation keeps; the last stage's head works on the gathered
    sequence; a layer's backward holds a residual gradient of s/2 tokens and a gathered one."""
    sb, sbh = S, S * H
    plain, split = sequence_parallel_memory(False, 0), sequence_parallel_memory(True, 0)
    assert plain.activations == 2 * (2 * 1000 + 8 * sb + sbh + 2 * sbh)  # 2 in flight
    assert split.activations == 2 * (2 * 1000 + 8 * sb + sbh / 2 + 2 * sbh / 2)
    assert plain.workspace == 2 * S * (2 * F / 2 + 2 * H)
    assert split.workspace == 2 * S * (2 * F / 2 + 1.5 * H)
    assert sequence_parallel_memory(True, 1).activations == \
        sequence_parallel_memory(False, 1).activations
    full = RecomputeConfig("full", "uniform", 1)
    assert sequence_parallel_memory(True, 0, full).activations == \
        2 * (2 * 2 * sbh / 2 + 8 * sb + sbh / 2 + 2 * sbh / 2)
    assert (split.params, split.grads, split.optimizer) == \
        (plain.params, plain.grads, plain.optimizer)


@pytest.mark.parametrize("switches, t, elements", [
    ({}, 1, 3 * H),  # views of the QKV output
    ({}, 2, 3 * H / 2),
    ({"position_embedding_type": "rope"}, 1, 5 * H),  # rotated q, k; v a view of all of QKV
    ({"num_query_groups": 2}, 1, 3 * H),  # q copied out of 2 groups; k, v repeated
    ({"num_query_groups": 2}, 2, (2 * H + 2 * H) / 2),  # 1 group a rank: q a view of QKV (2h/t)
    ({"num_query_groups": 2, "position_embedding_type": "rope"}, 2, 3 * H / 2),
    # --qk-layernorm: normed q and k; the LayerNorms keep their inputs, views of the QKV output
    ({"qk_layernorm": True}, 1, 5 * H),  # which v's view keeps anyway
    ({"qk_layernorm": True, "num_query_groups": 2}, 1, 3 * H + 2 * H + H),  # + q's copy
    ({"qk_layernorm": True, "num_query_groups": 2}, 2, (3 * H + 2 * H) / 2),  # q a view at t = 2
    # RMSNorm in half precision: q's and k's fp32 copies (2 elements' bytes each) and their
    # normalised values
    ({"qk_layernorm": True, "normalization": "RMSNorm"}, 1, 5 * H + 3 * 2 * H),
    # --kv-channels: as wide as the heads; 4 heads of 32 (2h, the QKV output 6h): rotated q and k
    ({"kv_channels": 32, "position_embedding_type": "rope"}, 1, 2 * 2 * H + 6 * H),
    # 2 groups of 2 heads of 32 at t = 2: q a view of the QKV output (2h + 2 x h), k, v repeated
    ({"kv_channels": 32, "num_query_groups": 2}, 2, (4 * H + 2 * 2 * H) / 2),
    # 6 heads of 16 (1.5h, the QKV output 4.5h): normed q and k, views of the QKV output
    ({"num_attention_heads": 6, "kv_channels": 16, "qk_layernorm": True}, 1, 2 * 1.5 * H + 4.5 * H),
])
def test_what_the_attention_keeps_of_q_k_and_v_under_selective_recomputation(switches, t,
                                                                             elements):
    """The core's inputs and --qk-layernorm's stashes, in 2-byte elements per token."""
    model = dataclasses.replace(MODEL, **switches)
    assert qkv_stash_bytes(model, t, 2, selective=True) == 2 * elements


def test_qk_layernorm_stashes():
    """Without recomputation the core keeps its own copies of q, k and v (3h/t), and the q/k norms
    their stashes over this rank's heads: LayerNorm its inputs, views of the whole QKV output;
    RMSNorm in fp32 those views and the normalised values (h + kv elements), in half precision
    fp32 copies of its inputs instead of the views."""
    qk = dataclasses.replace(MODEL, qk_layernorm=True)
    for t in (1, 2):
        assert qkv_stash_bytes(qk, t, 2) == 2 * (3 * H + 3 * H) / t
    llama = dataclasses.replace(LLAMA, qk_layernorm=True)  # kv = 2 groups x 16 = H / 2
    normed = H + H / 2
    # QKV output 2h, q copied out of 2 groups at t = 1 (a view at t = 2), normalised values
    assert qkv_stash_bytes(llama, 1, 4) == 4 * (3 * H + 2 * H + H + normed)
    assert qkv_stash_bytes(llama, 2, 4) == 4 * (3 * H + 2 * H + normed) / 2
    assert qkv_stash_bytes(llama, 1, 2) == 2 * 3 * H + (4 + 2) * normed
    assert layer_activation_bytes(llama, 2, 1, 2) - layer_activation_bytes(LLAMA, 2, 1, 2) == \
        (4 + 2) * normed / 2 * S
    # --kv-channels 32: q, k, v 2h wide, the QKV output 6h; Llama's normed q 2h and k 2 x 32
    wide = dataclasses.replace(qk, kv_channels=32)
    wide_llama = dataclasses.replace(llama, kv_channels=32)
    for t in (1, 2):
        assert qkv_stash_bytes(wide, t, 2) == 2 * (3 * 2 * H + 6 * H) / t
        assert qkv_stash_bytes(wide_llama, t, 2) == (2 * 3 * 2 * H + (4 + 2) * 3 * H) / t


def test_layernorm_1p_norms_keep_the_gains_they_compute():
    """weight + 1, e per channel: the layer's two norms over h, --qk-layernorm's two over the head
    size; replicated (whatever t)."""
    one_p = dataclasses.replace(MODEL, apply_layernorm_1p=True)
    qk = dataclasses.replace(MODEL_QK, apply_layernorm_1p=False)
    for t in (1, 2):
        assert layer_activation_bytes(one_p, t, 1, 2) - layer_activation_bytes(MODEL, t, 1, 2) == \
            2 * 2 * H
        assert layer_activation_bytes(MODEL_QK, t, 1, 2) - layer_activation_bytes(qk, t, 1, 2) == \
            2 * (2 * H + 2 * H // A)


def test_the_fp32_softmax_flags_keep_the_fused_attentions_bytes():
    """scaled_dot_product_attention computes its softmax in fp32 by default: the flags change
    nothing."""
    for flag in ("attention_softmax_in_fp32", "apply_query_key_layer_scaling"):
        flagged = dataclasses.replace(MODEL, **{flag: True})
        for t in (1, 2):
            assert attention_core_bytes(flagged, t, 1, 2) == attention_core_bytes(MODEL, t, 1, 2)


def test_the_fp32_softmax_under_half_precision_keeps_the_unfused_attentions_scores(
        reduced_precision_math_attention):
    """The fp32 softmax output (4), the dropout output (e) and mask (1) per score, and the
    inverted causal mask (s*s); the SDPA path's 2e + 1 otherwise. In fp32 the flags change
    nothing; selective recomputation recomputes the core either way."""
    scores = A * S * S
    fp32_softmax = dataclasses.replace(MODEL, attention_softmax_in_fp32=True)
    layer_scaling = dataclasses.replace(MODEL, apply_query_key_layer_scaling=True)
    for t in (1, 2):
        assert attention_core_bytes(MODEL, t, 1, 2) == 5 * scores / t
        assert attention_core_bytes(fp32_softmax, t, 1, 2) == 7 * scores / t + S * S
        assert attention_core_bytes(layer_scaling, t, 1, 2) == 7 * scores / t + S * S
        assert attention_core_bytes(fp32_softmax, t, 1, 4) == attention_core_bytes(MODEL, t, 1, 4)
    assert layer_activation_bytes(fp32_softmax, 2, 1, 2) - layer_activation_bytes(MODEL, 2, 1, 2) \
        == 2 * scores / 2 + S * S
    assert layer_activation_bytes(fp32_softmax, 1, 1, 2, selective=True) == \
        layer_activation_bytes(MODEL, 1, 1, 2, selective=True)
    # no attention dropout: the product with v reads the cast probabilities, no mask
    no_dropout = dataclasses.replace(fp32_softmax, attention_dropout=0.0)
    assert attention_core_bytes(no_dropout, 1, 3, 2) == 6 * 3 * scores + S * S
    # BERT fills by its padding mask, [b, 1, 1, s]
    bert = dataclasses.replace(fp32_softmax, model_type="bert")
    assert attention_core_bytes(bert, 1, 3, 2) == 7 * 3 * scores + 3 * S


def memory(precision=PrecisionConfig(fp16=True), schedule="2bw", stage=0, recompute=None,
           optimizer="adam", data_parallel=1, distributed=False, microbatches=4, per_layer=1000.0):
    parallel = ParallelConfig(pipeline_parallel=2, schedule=schedule,
                              use_distributed_optimizer=distributed)
    return estimate_stage_memory(MODEL, parallel, precision, recompute or RecomputeConfig(),
                                 optimizer, 1, microbatches, data_parallel, stage, per_layer)


P0 = EMBEDDING + 2 * LAYER  # stage 0 of 2


@pytest.mark.parametrize("precision, schedule, params, grads, stash", [
    (PrecisionConfig(), "flush", 4, 4, 0),  # fp32 master weights are the working weights
    (PrecisionConfig(), "gpipe", 4, 4, 0),
    (PrecisionConfig(), "2bw", 4, 8, 4),  # master = newest; master grad + accumulation; 2nd copy
    (PrecisionConfig(fp16=True), "2bw", 6, 6, 2),
    # bf16: fp32 gradients by default; under Flush the master gradients are that buffer
    (PrecisionConfig(bf16=True), "flush", 6, 4, 0),
    (PrecisionConfig(bf16=True), "2bw", 6, 8, 2),  # a backward of b+1 runs before step(b)
    (PrecisionConfig(bf16=True, grad_reduce_in_bf16=True), "flush", 6, 6, 0),
    (PrecisionConfig(fp16=True, accumulate_allreduce_grads_in_fp32=True), "flush", 6, 4, 0),
])
def test_weights_gradients_and_versions(precision, schedule, params, grads, stash):
    m = memory(precision, schedule)
    assert (m.params, m.grads, m.versions_stash, m.optimizer) == \
        (params * P0, grads * P0, stash * P0, 8 * P0)


def test_optimizer_and_distributed_optimizer():
    assert memory(optimizer="sgd").optimizer == 4 * P0
    # fp16 2BW: the master-gradient shard lives in the free working copy
    m = memory(data_parallel=4, distributed=True)
    assert (m.params, m.grads, m.optimizer) == (2 * P0 + P0, 2 * P0, 2 * P0)
    m = memory(schedule="flush", data_parallel=4, distributed=True)  # fp16 gradients: a shard
    assert (m.params, m.grads, m.optimizer) == (2 * P0 + P0, 2 * P0 + P0, 2 * P0)
    assert memory(data_parallel=4).optimizer == 8 * P0  # d alone shards nothing
    # fp32 2BW: the master weights are this rank's part of the newest version; their gradients
    # a separate shard
    m = memory(PrecisionConfig(), data_parallel=4, distributed=True)
    assert (m.params, m.grads, m.versions_stash) == (4 * P0, 4 * P0 + P0, 4 * P0)


def test_activations_follow_the_schedules_in_flight_counts():
    sb, sbh = S, S * H
    stage0 = 2 * 1000 + (8 * sb + sbh) + 2 * sbh  # 2 layers, ids + dropout mask, the stage output
    assert memory(schedule="2bw").activations == 2 * stage0  # p - r = 2 in flight
    assert memory(schedule="flush").activations == 2 * stage0
    assert memory(schedule="gpipe").activations == 4 * stage0  # all m microbatches
    last = 2 * 1000 + 2 * 2 * sbh + 4 * sb * V + 9 * sb  # norm in/out, fp32 softmax, targets
    assert memory(stage=1).activations == last
    full = memory(recompute=RecomputeConfig("full", "uniform", 1))
    assert full.activations == 2 * (2 * 2 * sbh + (8 * sb + sbh) + 2 * sbh)  # layer inputs only
    block = memory(recompute=RecomputeConfig("full", "block", 1))
    assert block.activations == 2 * (1000 + 2 * sbh + (8 * sb + sbh) + 2 * sbh)


def test_workspace_is_the_largest_transient():
    assert memory().workspace == 2 * S * (2 * F + 2 * H)  # a layer's gradients
    llama = estimate_stage_memory(LLAMA, ParallelConfig(pipeline_parallel=2), PrecisionConfig(
        bf16=True), RecomputeConfig(), "adam", 1, 4, 1, 0, 1000.0)
    assert llama.workspace == 2 * S * (4 * LLAMA_F + 2 * H)  # SwiGLU: twice the ffn-wide ones
    assert memory(stage=1).workspace == (2 + 8) * S * V  # the fp32 cross entropy
    full = memory(recompute=RecomputeConfig("full", "uniform", 2))
    assert full.workspace == 2 * S * (2 * F + 2 * H) + 2 * 1000  # a recomputed 2-layer chunk
    m = memory()
    assert m.total == m.params + m.grads + m.optimizer + m.versions_stash + m.activations + \
        m.workspace
    assert "GiB" in m.describe()


def test_measured_bytes_replace_the_analytic_ones():
    analytic = memory(per_layer=None)
    measured = memory(per_layer=2 * layer_activation_bytes(MODEL, 1, 1, 2))
    assert measured.activations - analytic.activations == 2 * 2 * layer_activation_bytes(MODEL, 1, 1, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="optimizer"):
        memory(optimizer="lamb")
    with pytest.raises(ValueError, match="stage 5"):
        memory(stage=5)
