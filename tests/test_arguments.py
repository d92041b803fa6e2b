"""Bad input ends with one clear line naming the flag and what was expected, exit code 2, no
traceback and no hang; good flags map onto the config dataclasses."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_2bw.arguments import ConfigError, parse_config
from megatron_2bw.config_checks import config_warnings, validate_for_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "16", "--micro-batch-size", "2", "--train-iters", "2", "--mock-data", "--vocab-size", "64"]


@pytest.mark.parametrize("extra,expected", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 must divide --num-attention-heads 4"),
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--global-batch-size", "5"], "--global-batch-size 5 must be divisible by --micro-batch-size 2"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--pipeline-layer-split", "1,x"], "--pipeline-layer-split expects comma-separated integers"),
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--rampup-batch-size", "16", "16", "5859375"],
     "--rampup-batch-size 16 16 5859375 ramps up to --global-batch-size: give it"),
    (["--rampup-batch-size", "16", "16"], "argument --rampup-batch-size: expected 3 arguments"),
    (["--lr", "-1e-3"], "--lr must be > 0 (with a rate of 0 training changes nothing), got -0.001"),
    (["--lr", "0"], "--lr must be > 0 (with a rate of 0 training changes nothing), got 0"),
    (["--min-lr", "-.5"], "--min-lr must be >= 0, got -0.5"),
    (["--sequence-parallel"], "--sequence-parallel splits the activations over the "
                              "tensor-parallel group: it needs --tensor-model-parallel-size > 1"),
    (["--context-parallel-size", "3"], "--seq-length 16 must be divisible by 6"),
    (["--memory-efficient-layer-norm"], "--memory-efficient-layer-norm runs NVIDIA apex's fused "
                                        "LayerNorm, but apex (apex.normalization) does not "
                                        "import here"),
])
def test_bad_flags_give_one_line(extra, expected):
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, *extra], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0] and lines[0].startswith("pretrain_gpt.py: error: ")
    assert "Traceback" not in result.stderr


def test_flags_fill_the_config():
    config, _ = parse_config([*TINY, "--tensor-model-parallel-size", "2", "--pipeline-schedule",
                              "flush", "--bf16", "--recompute-activations", "--clip-grad", "0"])
    assert config.parallel.tensor_parallel == 2 and config.parallel.pipeline_schedule == "flush"
    assert config.precision.bf16 and config.recompute.granularity == "selective"
    assert config.model.ffn_hidden_size == 128 and config.optimizer.clip_grad == 0.0


def test_default_schedule_is_2bw_with_a_pipeline():
    config, _ = parse_config([*TINY, "--pipeline-model-parallel-size", "2"])
    assert config.parallel.pipeline_schedule == "2bw"
    config.training.global_batch_size = 2
    with pytest.raises(ConfigError, match="needs at least as many microbatches per batch as stages"):
        validate_for_world(config, 2)


def test_missing_data_flag_is_named():
    with pytest.raises(ConfigError, match="--data-path"):
        parse_config([a for a in TINY if a not in ("--mock-data",)])


# The flags of Megatron-LM's own example scripts (examples/pretrain_gpt.sh, the 345M GPT, and
# examples/bert/train_bert_340m_distributed.sh), paths aside: such a script must carry over. The
# GPT list adds the switches that turn Megatron-LM's fused kernels off, common in users' scripts.
MEGATRON_GPT_345M = [
    "--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--seq-length", "1024",
    "--max-position-embeddings", "1024", "--train-iters", "500000", "--lr-decay-iters", "320000",
    "--save", "ckpt", "--load", "ckpt", "--data-path", "my-gpt2_text_document",
    "--vocab-file", "gpt2-vocab.json", "--merge-file", "gpt2-merges.txt", "--data-impl", "mmap",
    "--split", "949,50,1", "--distributed-backend", "nccl", "--lr", "0.00015", "--min-lr", "1.0e-5",
    "--lr-decay-style", "cosine", "--weight-decay", "1e-2", "--clip-grad", "1.0",
    "--lr-warmup-fraction", ".01", "--checkpoint-activations", "--log-interval", "100",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion",
    "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10", "--fp16"]
MEGATRON_BERT_340M = [
    "--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--seq-length", "512", "--max-position-embeddings", "512", "--attention-backend", "auto",
    "--micro-batch-size", "4", "--global-batch-size", "32", "--train-iters", "1000000",
    "--weight-decay", "1e-2", "--clip-grad", "1.0", "--fp16", "--lr", "0.0001",
    "--lr-decay-iters", "990000", "--lr-decay-style", "linear", "--min-lr", "1.0e-5",
    "--lr-warmup-fraction", ".01", "--tensor-model-parallel-size", "8",
    "--pipeline-model-parallel-size", "16", "--data-path", "my-bert_text_sentence",
    "--vocab-file", "bert-vocab.txt", "--split", "949,50,1", "--log-interval", "100",
    "--save-interval", "10000", "--eval-interval", "1000", "--save", "ckpt", "--load", "ckpt",
    "--eval-iters", "10", "--tensorboard-dir", "tb"]


# The model block of Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (its Transformer
# Engine and fused-attention switches left out) with its sample-based schedule.
MEGATRON_LLAMA3_8B = [
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--kv-channels", "128", "--seq-length", "8192", "--max-position-embeddings", "8192",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu", "--init-method-std",
    "0.0134", "--normalization", "RMSNorm", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--micro-batch-size", "1", "--global-batch-size",
    "128", "--train-samples", "1953125000", "--lr-decay-samples", "1949218748",
    "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr", "0.00001",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--mock-data", "--vocab-size",
    "128256"]


def test_megatron_llama_script_carries_over():
    config, _ = parse_config(MEGATRON_LLAMA3_8B)
    m = config.model
    assert (m.normalization, m.add_bias_linear, m.swiglu, m.position_embedding_type) \
        == ("RMSNorm", False, True, "rope")
    assert (m.query_groups, m.head_dim, m.rotary_base, m.ffn_hidden_size) == (8, 128, 1e6, 14336)
    assert m.untie_embeddings_and_output_weights and config.precision.bf16
    assert validate_for_world(config, 64) == 64  # t = 1, d = 64
    assert config.training.train_iters == 1953125000 // 128


def test_qwen3_head_size_and_attention_numerics_flags():
    config, _ = parse_config([*TINY, "--qk-layernorm", "--apply-layernorm-1p",
                              "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling"])
    m = config.model
    assert m.qk_layernorm and m.apply_layernorm_1p
    assert m.attention_softmax_in_fp32 and m.apply_query_key_layer_scaling
    wide, _ = parse_config([*TINY, "--num-attention-heads", "3", "--kv-channels", "16"])
    assert (wide.model.head_dim, wide.model.attention_size, wide.model.qkv_size) == (16, 48, 144)
    plain, _ = parse_config(TINY)
    assert plain.model.head_dim == 8
    assert not (plain.model.qk_layernorm or plain.model.apply_layernorm_1p
                or plain.model.attention_softmax_in_fp32)


def test_rope_flags_and_their_older_names():
    rope, _ = parse_config([*TINY, "--use-rotary-position-embeddings", "--no-position-embedding"])
    assert rope.model.position_embedding_type == "rope"
    none, _ = parse_config([*TINY, "--no-position-embedding"])
    assert none.model.position_embedding_type == "none"
    mqa, _ = parse_config([*TINY, "--group-query-attention", "--norm-epsilon", "1e-6",
                           "--use-flash-attn",  # SDPA picks flash where it can anyway
                           "--use-mcore-models", "--transformer-impl", "local"])
    assert mqa.model.query_groups == 1 and mqa.model.layernorm_epsilon == 1e-6


def test_megatron_gpt_example_script_carries_over():
    config, _ = parse_config(MEGATRON_GPT_345M)
    opt = config.optimizer
    assert (opt.lr_warmup_fraction, opt.lr_decay_iters, opt.lr_decay_style) == (0.01, 320000, "cosine")
    # --checkpoint-activations: the older name of full recomputation of every layer
    assert (config.recompute.granularity, config.recompute.method, config.recompute.num_layers) \
        == ("full", "uniform", 1)
    assert config.precision.fp16 and config.data.split == "949,50,1"
    assert validate_for_world(config, 1) == 1


def test_megatron_bert_example_script_carries_over():
    config, _ = parse_config(MEGATRON_BERT_340M, model_type="bert")
    assert config.optimizer.lr_warmup_fraction == 0.01
    assert (config.parallel.tensor_parallel, config.parallel.pipeline_parallel) == (8, 16)
    assert config.recompute.granularity is None
    # one deliberate difference: Megatron-LM runs 1F1B with fewer microbatches than stages
    # (m = 32/4 = 8 < p = 16); the issue makes that an error that says why
    with pytest.raises(ConfigError, match="m = global/\\(micro\\*d\\) = 8 < p = 16"):
        validate_for_world(config, 128)


@pytest.mark.parametrize("extra,expected", [
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"],
     "give --lr-warmup-fraction or --lr-warmup-iters, not both"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1], got 1.5"),
    (["--attention-backend", "flash"], "--attention-backend flash: megatron_2bw runs torch's "
                                       "scaled_dot_product_attention"),
    (["--data-impl", "lazy"], "argument --data-impl: invalid choice: 'lazy'"),
    (["--checkpoint-num-layers", "2"], "--checkpoint-num-layers only applies with "
                                       "--checkpoint-activations"),
    (["--num-query-groups", "2"], "--num-query-groups takes effect only with --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-query-groups 3 must divide --num-attention-heads 4"),
    (["--group-query-attention", "--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size 2 must divide the query groups (1, --num-query-groups)"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.2"],
     "--rotary-percent 0.2 of the head size 8 must rotate a positive even number of channels"),
    (["--kv-channels", "0"], "--kv-channels must be a positive integer, got 0"),
    (["--num-attention-heads", "3"], "--num-attention-heads 3 must divide --hidden-size 32 (or "
                                     "give the head size with --kv-channels)"),
    (["--swiglu", "--hidden-size", "16"], "--ffn-hidden-size must be a positive integer, got 0"),
    (["--use-rope-scaling"], "--use-rope-scaling needs --position-embedding-type rope"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine: "
                                                   "megatron_2bw builds its layers from torch ops"),
    (["--num-experts", "8"], "--num-experts 8: mixture-of-experts layers are not implemented"),
    (["--ckpt-format", "torch_dist"], "--ckpt-format torch_dist: megatron_2bw writes its own"),
    (["--fp8-format", "hybrid"], "--fp8-format hybrid: FP8 needs Transformer Engine"),
    (["--async-save"], "--async-save is not supported"),
    (["--tp-comm-overlap"], "--tp-comm-overlap is not supported"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 reduces the gradients in bf16: it needs "
                                "--bf16"),
    (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
     "--grad-reduce-in-bf16 reduces the gradients in bf16: it needs --bf16 and excludes"),
    (["--check-for-nan-in-loss-and-grad", "--no-check-for-nan-in-loss-and-grad"],
     "give --check-for-nan-in-loss-and-grad or --no-check-for-nan-in-loss-and-grad, not both"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--start-weight-decay", "0.1"], "--start-weight-decay and --end-weight-decay go with "
                                      "--weight-decay-incr-style linear or cosine"),
    (["--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"],
     "--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"),
    (["--lr-warmup-init", "-1"], "--lr-warmup-init must be >= 0"),
    (["--manual-gc-interval", "-1"], "--manual-gc-interval must be >= 0"),
    (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval must be a positive integer"),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"],
     "--profile-step-start 5 must be >= 0 and below --profile-step-end 5"),
])
def test_megatron_flags_refused_with_the_reason(extra, expected):
    with pytest.raises(ConfigError) as error:
        parse_config([*TINY, *extra])
    assert expected in str(error.value)


def test_checkpoint_num_layers_sets_the_chunk():
    config, _ = parse_config([*TINY, "--checkpoint-activations", "--checkpoint-num-layers", "2"])
    assert (config.recompute.granularity, config.recompute.num_layers) == ("full", 2)


def test_per_token_loss_is_a_gpt_flag():
    config, _ = parse_config([*TINY, "--calculate-per-token-loss"])
    assert config.training.calculate_per_token_loss
    with pytest.raises(ConfigError, match="--calculate-per-token-loss applies to GPT pretraining"):
        parse_config([*TINY, "--calculate-per-token-loss"], model_type="bert")


@pytest.mark.parametrize("flag", ["--eod-mask-loss", "--reset-position-ids",
                                  "--reset-attention-mask"])
def test_document_flags_need_gpt_and_an_end_of_document_token(monkeypatch, flag):
    from megatron_2bw.data import tokenizers
    from megatron_2bw.training.startup import build_checked_tokenizer
    with pytest.raises(ConfigError, match="--reset-attention-mask apply to GPT pretraining only"):
        parse_config([*TINY, flag], model_type="bert")
    config, _ = parse_config([*TINY, flag])
    assert config.data.uses_document_boundaries
    no_eod = tokenizers.NullTokenizer(63)
    no_eod._special_ids["eod"] = None
    monkeypatch.setattr(tokenizers, "build_tokenizer", lambda data, vocab_size: no_eod)
    with pytest.raises(ConfigError, match="--reset-attention-mask need an end-of-document token, "
                                          "which NullTokenizer lacks"):
        build_checked_tokenizer(config)


WITHOUT_ITERS = TINY[:TINY.index("--train-iters")] + TINY[TINY.index("--train-iters") + 2:]


def test_train_samples_count_whole_global_batches():
    config, _ = parse_config([*WITHOUT_ITERS, "--train-samples", "70", "--global-batch-size", "8",
                              "--lr-decay-samples", "60", "--lr-warmup-samples", "12"])
    validate_for_world(config, 2)
    assert config.training.train_iters == 8  # 70 // 8: Megatron-LM's count
    assert (config.optimizer.lr_decay_samples, config.optimizer.lr_warmup_samples) == (60, 12)


@pytest.mark.parametrize("extra,expected", [
    (["--train-samples", "64", "--train-iters", "3"], "give --train-iters or --train-samples, not both"),
    (["--lr-decay-samples", "64"], "--lr-decay-samples and --lr-warmup-samples go with --train-samples"),
    (["--train-samples", "64", "--lr-decay-iters", "3"],
     "with --train-samples give the schedule in samples"),
    (["--train-samples", "64", "--lr-warmup-samples", "8", "--lr-warmup-fraction", "0.1"],
     "give --lr-warmup-fraction or --lr-warmup-samples, not both"),
    (["--train-samples", "0"], "--train-samples must be a positive integer, got 0"),
])
def test_sample_based_flags_are_checked(extra, expected):
    with pytest.raises(ConfigError) as error:
        parse_config([*WITHOUT_ITERS, *extra])
    assert expected in str(error.value)


def test_train_samples_below_one_batch_is_named():
    config, _ = parse_config([*WITHOUT_ITERS, "--train-samples", "3", "--global-batch-size", "4"])
    with pytest.raises(ConfigError, match="--train-samples 3 is less than one --global-batch-size 4"):
        validate_for_world(config, 1)


def test_untied_output_layer_is_gpt_only():
    config, _ = parse_config([*TINY, "--untie-embeddings-and-output-weights"])
    assert config.model.untie_embeddings_and_output_weights
    with pytest.raises(ConfigError, match="--untie-embeddings-and-output-weights applies to GPT"):
        parse_config([*TINY, "--untie-embeddings-and-output-weights"], model_type="bert")


# The training block of Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh without its FP8
# switches (refused below), and its parallel, data and logging flags.
MEGATRON_LLAMA3_8B_RUN = [
    "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16",
    "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--context-parallel-size", "1", "--sequence-parallel", "--use-distributed-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--tokenizer-type", "NullTokenizer",
    "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files", "--num-workers", "1", "--log-interval", "1", "--eval-iters", "32",
    "--eval-interval", "100", "--save-interval", "1000", "--log-throughput", "--profile",
    "--profile-step-start", "4", "--profile-step-end", "6", "--distributed-timeout-minutes", "60",
    "--apply-layernorm-1p"]


def test_megatron_llama3_training_flags_carry_over():
    config, _ = parse_config([*TINY, *MEGATRON_LLAMA3_8B_RUN, "--tensor-model-parallel-size", "2"])
    opt, train, log = config.optimizer, config.training, config.logging
    assert (opt.decoupled_lr, opt.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    assert train.manual_gc and train.manual_gc_eval and train.empty_unused_memory_level == 1
    assert train.check_for_nan_in_loss_and_grad  # Megatron-LM's default
    assert (log.profile, log.profile_step_start, log.profile_step_end, log.profile_ranks) == \
        (True, 4, 6, [0])
    assert config.precision.bf16 and config.model.sequence_parallel


def test_megatron_schedule_and_logging_flags_fill_the_config():
    config, _ = parse_config([*TINY, "--lr-warmup-init", "1e-6", "--weight-decay-incr-style",
                              "cosine", "--start-weight-decay", "0.0", "--end-weight-decay", "0.1",
                              "--no-check-for-nan-in-loss-and-grad", "--manual-gc-interval", "5",
                              "--no-manual-gc-eval", "--deterministic-mode", "--log-params-norm",
                              "--log-num-zeros-in-grad", "--tensorboard-log-interval", "3",
                              "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                              "--profile-ranks", "0", "1"])
    opt, train, log = config.optimizer, config.training, config.logging
    assert (opt.lr_warmup_init, opt.weight_decay_incr_style) == (1e-6, "cosine")
    assert (opt.start_weight_decay, opt.end_weight_decay) == (0.0, 0.1)
    assert not train.check_for_nan_in_loss_and_grad and not train.manual_gc_eval
    assert train.manual_gc_interval == 5 and train.deterministic_mode
    assert log.log_params_norm and log.log_num_zeros_in_grad and log.tensorboard_log_interval == 3
    assert log.log_timers_to_tensorboard and log.log_validation_ppl_to_tensorboard
    assert log.profile_ranks == [0, 1]


def test_profiled_ranks_must_exist():
    config, _ = parse_config([*TINY, "--profile", "--profile-ranks", "0", "3"])
    with pytest.raises(ConfigError, match=r"--profile-ranks \[3\] outside the world's ranks 0..1"):
        validate_for_world(config, 2)


def test_openai_gelu_is_an_architecture_switch_of_the_gelu_mlp():
    config, _ = parse_config([*TINY, "--openai-gelu"])
    assert config.model.openai_gelu and config.model.gelu_approximation == "tanh"
    with pytest.raises(ConfigError, match="--swiglu's MLP has none: give one of them"):
        parse_config([*TINY, "--openai-gelu", "--swiglu"])


PIPEDREAM = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "pipedream"]


def test_pipedream_flags_fill_the_config():
    config, _ = parse_config([*TINY, *PIPEDREAM, "--untie-embeddings-and-output-weights",
                              "--vertical-sync"])
    assert config.parallel.pipeline_schedule == "pipedream-vs"
    config, _ = parse_config([*TINY, *PIPEDREAM, "--untie-embeddings-and-output-weights"])
    assert config.parallel.pipeline_schedule == "pipedream"
    # one microbatch per update (m = 1 < p) is PipeDream's own setting: no m >= p rule
    config.training.global_batch_size = 2
    assert validate_for_world(config, 2) == 1


@pytest.mark.parametrize("extra,expected", [
    (["--vertical-sync"], "--vertical-sync applies to --pipeline-schedule pipedream only, got flush"),
    (PIPEDREAM, "--pipeline-schedule pipedream needs --untie-embeddings-and-output-weights"),
    ([*PIPEDREAM, "--untie-embeddings-and-output-weights", "--fp16"],
     "--pipeline-schedule pipedream --fp16 needs a static --loss-scale or --vertical-sync"),
])
def test_pipedream_combinations_refused_in_one_line(extra, expected):
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, *extra], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_pipedream_fp16_with_a_static_scale_or_vertical_sync_is_accepted():
    for extra in (["--loss-scale", "1024"], ["--vertical-sync"]):
        config, _ = parse_config([*TINY, *PIPEDREAM, "--untie-embeddings-and-output-weights",
                                  "--fp16", *extra])
        assert config.precision.fp16


@pytest.mark.parametrize("flags, fp32_gradients", [
    ([], True),  # fp32 training: fp32 everything
    (["--bf16"], True),  # Megatron-LM's default for bf16
    (["--bf16", "--grad-reduce-in-bf16"], False),
    (["--bf16", "--accumulate-allreduce-grads-in-fp32"], True),
    (["--fp16"], False),
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], True),
])
def test_bf16_accumulates_and_reduces_gradients_in_fp32_unless_told(flags, fp32_gradients):
    from megatron_2bw.training.stage import grad_dtype
    config, _ = parse_config([*TINY, *flags])
    assert (grad_dtype(config) == torch.float32) == fp32_gradients


def test_pipedream_with_tied_embeddings_is_refused_for_any_built_config():
    config, _ = parse_config([*TINY, *PIPEDREAM, "--untie-embeddings-and-output-weights"])
    config.model.untie_embeddings_and_output_weights = False
    with pytest.raises(ConfigError, match="pipedream needs --untie-embeddings-and-output-weights"):
        validate_for_world(config, 2)


def test_negative_numbers_in_scientific_notation_parse_as_values():
    """argparse before Python 3.13 reads "-1e-3" as an option ("expected one argument")."""
    config = parse_config([*TINY, "--lr", "1e-3", "--min-lr", "0", "--lr-warmup-init", "0",
                           "--adam-eps", "1E-8"])[0]
    assert config.optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match="--lr-warmup-init must be >= 0, got -1e-05"):
        parse_config([*TINY, "--lr-warmup-init", "-1e-5"])
    assert parse_config([*TINY, "--lr", "0", "--skip-train"])[0].optimizer.lr == 0  # no training


@pytest.mark.parametrize("extra,expected", [
    (["--lr-warmup-iters", "100"], "warning: --lr-warmup-iters makes the warm-up 100 iterations, "
                                   "longer than the run's 2: the learning rate ends at 2e-05, "
                                   "never reaching --lr 0.001"),
    (["--lr-warmup-iters", "2"], None),
    (["--lr-warmup-iters", "100", "--skip-train"], None),
    (["--train-samples", "8", "--global-batch-size", "4", "--lr-warmup-samples", "12"],
     "warning: --lr-warmup-samples makes the warm-up 3 iterations, longer than the run's 2"),
])
def test_a_warm_up_longer_than_the_run_is_a_warning(extra, expected):
    flags = [*TINY, "--lr", "1e-3", *extra]
    if "--train-samples" in extra:
        at = flags.index("--train-iters")
        del flags[at:at + 2]
    config = parse_config(flags)[0]
    validate_for_world(config, 1)
    warnings = config_warnings(config)
    if expected is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(expected), warnings
