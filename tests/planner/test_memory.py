import pytest

from megatron_2bw.config import ModelConfig, ParallelConfig, PrecisionConfig, RecomputeConfig
from megatron_2bw.planner.memory import (estimate_stage_memory, layer_activation_bytes,
                                         layer_parameters, stage_parameters)

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=1000)  # vocabulary padded to 1024
H, S, A, F, V = 64, 32, 4, 256, 1024
LAYER = 12 * H * H + 13 * H  # QKV, dense, fc1, fc2 weights and biases, two LayerNorms
EMBEDDING = V * H + S * H  # word + learned positions
HEAD = 2 * H + V * H  # final LayerNorm + the last stage's copy of the tied word embeddings


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


def test_activation_formula_is_korthikantis_count():
    sbh = S * 1 * H
    # sbh (34 + 5 a s / h) with 2-byte activations, t = 1
    assert layer_activation_bytes(MODEL, 1, 1, 2) == sbh * 34 + 5 * A * S * S
    # sbh (10 + 24/t + 5 a s / (h t)) for t = 2
    assert layer_activation_bytes(MODEL, 2, 1, 2) == sbh * (10 + 12) + 5 * A * S * S / 2
    assert layer_activation_bytes(MODEL, 1, 3, 2, selective=True) == 3 * sbh * 34
    assert layer_activation_bytes(MODEL, 1, 1, 4) == sbh * (16 * 4 + 2) + 9 * A * S * S


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
    (PrecisionConfig(), "2bw", 8, 8, 4),  # master + working, master grad + accumulation, 2nd copy
    (PrecisionConfig(fp16=True), "2bw", 6, 6, 2),
    (PrecisionConfig(bf16=True), "flush", 6, 6, 0),
    (PrecisionConfig(fp16=True, accumulate_allreduce_grads_in_fp32=True), "flush", 6, 8, 0),
])
def test_weights_gradients_and_versions(precision, schedule, params, grads, stash):
    m = memory(precision, schedule)
    assert (m.params, m.grads, m.versions_stash, m.optimizer) == \
        (params * P0, grads * P0, stash * P0, 8 * P0)


def test_optimizer_and_distributed_optimizer():
    assert memory(optimizer="sgd").optimizer == 4 * P0
    m = memory(data_parallel=4, distributed=True)
    assert (m.params, m.grads, m.optimizer) == (2 * P0 + P0, 2 * P0 + P0, 2 * P0)
    assert memory(data_parallel=4).optimizer == 8 * P0  # d alone shards nothing


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
