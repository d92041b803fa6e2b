"""Megatron-compatible command-line flags -> a `Config`, checked by config_checks.py.

Every flag is declared once, next to the config field it fills, so that tools can share the parser,
know which flags a user actually typed (`explicit_fields`) and fill the rest from a checkpoint.
A bad flag ends the program with one line naming the flag (`ConfigError` -> `exit_on_config_error`).
"""
from __future__ import annotations

import argparse
import re
import sys
from contextlib import contextmanager

from megatron_2bw.batch_schedule import parse_step_schedule
from megatron_2bw.config import MUON_SCALE_MODES, Config, ConfigError  # noqa: F401 - ConfigError is re-exported
from megatron_2bw.config_checks import validate
from megatron_2bw.data.tokenizers import TOKENIZER_TYPES


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse (before Python 3.13) takes "-1e-3" for an option: a value such as
        # `--lr -1e-3` must reach the checks, which name the flag and the range it needs.
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message):  # one line, no usage dump
        raise ConfigError(message)


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _bool_flag(group, flag, section, field, help):
    group.add_argument(flag, action="store_true", default=None, help=help)
    _FIELDS.append((flag, section, field))


# (flag, section, field) of every flag that maps onto Config
_FIELDS: list[tuple[str, str, str]] = []


def config_fields_of_flags() -> dict[str, tuple[str, str]]:
    """flag -> (Config section, field) for the parser build_parser last built (docs/flags.md)."""
    return {flag: (section, field) for flag, section, field in _FIELDS}


def _flag(group, flag, section, field, **kwargs):
    group.add_argument(flag, default=None, **kwargs)
    _FIELDS.append((flag, section, field))


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def build_parser(description: str = "", extra_args_provider=None) -> argparse.ArgumentParser:
    _FIELDS.clear()
    parser = _Parser(description=description, allow_abbrev=False)

    g = parser.add_argument_group("model")
    _flag(g, "--num-layers", "model", "num_layers", type=int)
    _flag(g, "--hidden-size", "model", "hidden_size", type=int)
    _flag(g, "--num-attention-heads", "model", "num_attention_heads", type=int)
    _flag(g, "--ffn-hidden-size", "model", "ffn_hidden_size", type=int, help="default 4*hidden")
    _flag(g, "--seq-length", "model", "seq_length", type=int)
    _flag(g, "--max-position-embeddings", "model", "max_position_embeddings", type=int)
    _flag(g, "--vocab-size", "model", "vocab_size", type=int,
          help="vocabulary for --mock-data and NullTokenizer (otherwise from the tokenizer)")
    _flag(g, "--make-vocab-size-divisible-by", "model", "make_vocab_size_divisible_by", type=int)
    _flag(g, "--hidden-dropout", "model", "hidden_dropout", type=float)
    _flag(g, "--attention-dropout", "model", "attention_dropout", type=float)
    _flag(g, "--init-method-std", "model", "init_method_std", type=float)
    _flag(g, "--layernorm-epsilon", "model", "layernorm_epsilon", type=float)
    _flag(g, "--norm-epsilon", "model", "layernorm_epsilon", type=float,
          help="Megatron-LM's newer name of --layernorm-epsilon")
    _flag(g, "--normalization", "model", "normalization", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the layers' linear projections (Llama)")
    _bool_flag(g, "--add-qkv-bias", "model", "add_qkv_bias",
               "keep the qkv projection's bias under --disable-bias-linear (Qwen)")
    _bool_flag(g, "--swiglu", "model", "swiglu",
               "gated SiLU MLP; --ffn-hidden-size then defaults to 2/3 of 4h, a multiple of 64")
    _bool_flag(g, "--openai-gelu", "model", "openai_gelu",
               "GELU's tanh approximation, as GPT-2 was trained (transformers' gelu_new), instead "
               "of the exact erf GELU")
    _flag(g, "--position-embedding-type", "model", "position_embedding_type",
          choices=["learned_absolute", "rope", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="older name of --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="no learned absolute positions (with rope: rotary positions only)")
    _flag(g, "--rotary-percent", "model", "rotary_percent", type=float,
          help="share of each head's channels rotated (default 1.0)")
    _flag(g, "--rotary-base", "model", "rotary_base", type=float)
    _bool_flag(g, "--rotary-interleaved", "model", "rotary_interleaved",
               "rotate adjacent channel pairs instead of the two halves of a head")
    _bool_flag(g, "--use-rope-scaling", "model", "rope_scaling",
               "Llama 3.1's rotary frequencies: long wavelengths divided by --rope-scaling-factor")
    _flag(g, "--rope-scaling-factor", "model", "rope_scaling_factor", type=float)
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads under --group-query-attention (default 1)")
    _flag(g, "--kv-channels", "model", "kv_channels", type=int,
          help="the head size (default --hidden-size / --num-attention-heads)")
    _bool_flag(g, "--qk-layernorm", "model", "qk_layernorm",
               "normalise each head's queries and keys (before rotary positions)")
    _bool_flag(g, "--apply-layernorm-1p", "model", "apply_layernorm_1p",
               "norm weights hold gain - 1, initialised to 0 (zero-centred gamma)")
    _bool_flag(g, "--memory-efficient-layer-norm", "model", "memory_efficient_layer_norm",
               "LayerNorm through NVIDIA apex's fused kernel, which keeps its output instead of "
               "its input for the backward (needs apex; not with --torch-compile)")
    _bool_flag(g, "--attention-softmax-in-fp32", "model", "attention_softmax_in_fp32",
               "fp16/bf16: the attention softmax (and its mask) in fp32")
    _bool_flag(g, "--apply-query-key-layer-scaling", "model", "apply_query_key_layer_scaling",
               "fp16/bf16: divide attention scores by the layer number until the fp32 softmax")
    g.add_argument("--bert-no-binary-head", action="store_true", help="BERT without the SOP head")
    _bool_flag(g, "--untie-embeddings-and-output-weights", "model",
               "untie_embeddings_and_output_weights",
               "GPT: the output layer gets its own weights instead of the word embeddings'")
    for fusion in ("masked-softmax", "bias-gelu", "bias-dropout", "gradient-accumulation",
                   "bias-swiglu", "rope", "persist-layer-norm"):
        g.add_argument(f"--no-{fusion}-fusion", action="store_true",
                       help="Megatron-LM's switch off a fused kernel: accepted, megatron_2bw runs "
                            "torch's unfused ops")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="accepted: torch's scaled_dot_product_attention runs its flash kernel "
                        "wherever the device, dtype and mask allow it")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="accepted: megatron_2bw's layers follow Megatron core's layout")
    g.add_argument("--transformer-impl", default=None,
                   help="only 'local': megatron_2bw builds its layers from torch ops")
    g.add_argument("--attention-backend", default=None,
                   help="only 'auto' (Megatron-LM's default): torch's scaled_dot_product_attention "
                        "picks its kernel itself")

    g = parser.add_argument_group("parallelism")
    _flag(g, "--tensor-model-parallel-size", "parallel", "tensor_parallel", type=int)
    _flag(g, "--pipeline-model-parallel-size", "parallel", "pipeline_parallel", type=int)
    _flag(g, "--context-parallel-size", "parallel", "context_parallel", type=int,
          help="GPT: split every sequence over this many ranks of each data-parallel replica "
               "(default 1); keys and values travel around the ring of them (ring attention)")
    _flag(g, "--pipeline-schedule", "parallel", "schedule",
          choices=["2bw", "flush", "gpipe", "pipedream", "pipemare", "zb-h1", "interleaved",
                   "zb-v", "dualpipev", "v-half"],
          help="2bw (default when p > 1), flush (1F1B), gpipe, pipedream (weight stashing, an "
               "update per batch), pipemare (one weight version per stage, the backward reads "
               "the newest weights; docs/async_schedules.md), zb-h1 (1F1B with the backward "
               "split into input and weight gradients, the drain filled with weight gradients), "
               "interleaved (Megatron-LM's "
               "virtual stages; needs one of the virtual-pipeline flags), or a V with two model "
               "chunks per rank: zb-v (zero bubble), dualpipev (DualPipe cut in half, m >= 2p) "
               "or v-half (about half of 1F1B's activation memory); docs/sync_schedules.md")
    _bool_flag(g, "--vertical-sync", "parallel", "vertical_sync", "pipedream: every stage runs "
               "a batch on the weight version the first stage used (a uniform delay of p - 1)")
    _flag(g, "--virtual-pipeline-model-parallel-size", "parallel", "virtual_pipeline_parallel",
          type=int, help="interleaved: model chunks per pipeline rank (v)")
    _flag(g, "--num-layers-per-virtual-pipeline-stage", "parallel",
          "num_layers_per_virtual_pipeline_stage", type=int,
          help="interleaved: layers per model chunk (v = num-layers / p / this)")
    _flag(g, "--delay-compensation", "parallel", "delay_compensation",
          choices=["none", "predict", "dc", "ef", "nesterov"],
          help="asynchronous schedules: 'predict' (2bw, pipedream) runs each batch on the newest "
               "weights extrapolated along the last update over the stage's delay, 'dc' (2bw) "
               "corrects each stale gradient (DC-ASGD), 'ef' (2bw) adds beta*(u_b - u_{b-1}) to "
               "the optimizer's step u_b (error feedback), 'nesterov' (2bw) steps from the "
               "look-ahead W + gamma*(W - W_previous); default none")
    _flag(g, "--delay-compensation-lambda", "parallel", "delay_compensation_lambda", type=float,
          help="the correction's coefficient: dc's lambda of g + lambda*g*g*(W_new - W_read) "
               "(default 0.04), ef's beta (default 1), nesterov's gamma in [0, 1) (default 0.5)")
    _flag(g, "--pipemare-lr-warmup-iters", "parallel", "pipemare_lr_warmup_iters", type=int,
          help="pipemare T1: stage s's learning rate is divided by tau_s^(1 - min(it/K, 1)) "
               "(tau_s its delay in updates); K iterations, 0 (default) off")
    _flag(g, "--pipemare-discrepancy-decay", "parallel", "pipemare_discrepancy_decay",
          type=float, help="pipemare T2: D in [0, 1) of the moving average of each stage's "
                           "updates that predicts the backward's weights back to the forward's "
                           "(gamma_s = D^(1/tau_s)); 0 (default) off")
    _flag(g, "--pipeline-layer-split", "parallel", "layer_split", type=str,
          help="layers per stage, e.g. 5,7,7,5")
    _flag(g, "--pipeline-repartition-interval", "parallel", "repartition_interval", type=int,
          help="every N iterations measure each layer's time, plan a new layer split and "
               "recompute plan, and move layers between stages if it pays (docs/repartition.md)")
    _flag(g, "--pipeline-repartition-min-gain", "parallel", "repartition_min_gain", type=float,
          help="the predicted speed-up a repartition needs (a fraction, default 0.05)")
    _flag(g, "--distributed-backend", "parallel", "distributed_backend", choices=["nccl", "gloo"])
    _flag(g, "--distributed-timeout-minutes", "parallel", "timeout_minutes", type=float)
    _bool_flag(g, "--auto-parallel", "parallel", "auto_parallel", "choose t, p, micro batch, "
               "recomputation and schedule with the planner")
    _flag(g, "--planner-hardware", "parallel", "planner_hardware", type=str,
          help="--auto-parallel: hardware YAML, a shipped name (p3.16xlarge, dgx-a100, dgx-h100) "
               "or 'local' (detected and profiled at start-up; the default)")
    _flag(g, "--planner-profile-cache", "parallel", "planner_profile_cache", type=str,
          help="--auto-parallel: directory caching the measured profiles")
    _bool_flag(g, "--use-distributed-optimizer", "parallel", "use_distributed_optimizer",
               "shard fp32 master weights and optimizer state over data-parallel replicas")
    _flag(g, "--ddp-bucket-size", "parallel", "ddp_bucket_size", type=int)
    _bool_flag(g, "--overlap-grad-reduce", "parallel", "overlap_grad_reduce",
               "start each bucket's data-parallel all-reduce during the batch's last backward, as "
               "soon as its gradients are in (default on GPUs; on CPUs the all-reduce starts "
               "after the backward)")
    _bool_flag(g, "--bind-cores-to-rank", "parallel", "bind_cores_to_rank",
               "bind each local rank to its own share of the node's CPU cores (as DeepSpeed's "
               "launcher option of that name)")
    _bool_flag(g, "--sequence-parallel", "model", "sequence_parallel",
               "split the activations between tensor-parallel regions (norms, dropout, residual "
               "adds, pipeline messages) along the sequence over the tensor-parallel group")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher; the environment is used instead")

    g = parser.add_argument_group("mixed precision")
    _bool_flag(g, "--fp16", "precision", "fp16", "fp16 weights and activations, fp32 master")
    _bool_flag(g, "--bf16", "precision", "bf16", "bf16 weights and activations, fp32 master")
    _flag(g, "--loss-scale", "precision", "loss_scale", type=float, help="static loss scale")
    _flag(g, "--initial-loss-scale", "precision", "initial_loss_scale", type=float)
    _flag(g, "--min-loss-scale", "precision", "min_loss_scale", type=float)
    _flag(g, "--loss-scale-window", "precision", "loss_scale_window", type=int)
    _flag(g, "--hysteresis", "precision", "hysteresis", type=int)
    _bool_flag(g, "--accumulate-allreduce-grads-in-fp32", "precision",
               "accumulate_allreduce_grads_in_fp32", "fp32 gradient buffers")
    _bool_flag(g, "--grad-reduce-in-bf16", "precision", "grad_reduce_in_bf16",
               "with --bf16: accumulate and reduce the gradients in bf16 (by default --bf16 "
               "does both in fp32, as Megatron-LM)")

    g = parser.add_argument_group("activation recomputation")
    _flag(g, "--recompute-granularity", "recompute", "granularity", choices=["full", "selective"])
    _flag(g, "--recompute-method", "recompute", "method", choices=["uniform", "block"])
    _flag(g, "--recompute-num-layers", "recompute", "num_layers", type=int)
    _flag(g, "--recompute-num-layers-per-stage", "recompute", "num_layers_per_stage", type=str,
          help="how many of each stage's layers recompute in full (its first ones), e.g. 3,2,1,0")
    g.add_argument("--recompute-activations", action="store_true",
                   help="shorthand for --recompute-granularity selective")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="older Megatron-LM name for --recompute-granularity full "
                        "--recompute-method uniform")
    g.add_argument("--checkpoint-num-layers", type=int, default=None,
                   help="with --checkpoint-activations: layers per recomputed chunk (default 1)")

    g = parser.add_argument_group("optimizer")
    _flag(g, "--optimizer", "optimizer", "optimizer", choices=["adam", "sgd", "muon"],
          help="muon: Muon for the hidden weight matrices, AdamW (the --adam-* flags) for the "
               "rest (docs/optimizers.md)")
    _flag(g, "--lr", "optimizer", "lr", type=float)
    _flag(g, "--min-lr", "optimizer", "min_lr", type=float)
    _flag(g, "--lr-warmup-iters", "optimizer", "lr_warmup_iters", type=int)
    _flag(g, "--lr-warmup-fraction", "optimizer", "lr_warmup_fraction", type=float,
          help="warm-up as a fraction of --lr-decay-iters (default --train-iters), instead of "
               "--lr-warmup-iters")
    _flag(g, "--lr-decay-style", "optimizer", "lr_decay_style", choices=["constant", "linear", "cosine"])
    _flag(g, "--lr-decay-iters", "optimizer", "lr_decay_iters", type=int)
    _flag(g, "--lr-warmup-samples", "optimizer", "lr_warmup_samples", type=int,
          help="with --train-samples: warm-up in samples")
    _flag(g, "--lr-decay-samples", "optimizer", "lr_decay_samples", type=int,
          help="with --train-samples: decay length in samples (default --train-samples)")
    _flag(g, "--weight-decay", "optimizer", "weight_decay", type=float)
    _flag(g, "--adam-beta1", "optimizer", "adam_beta1", type=float)
    _flag(g, "--adam-beta2", "optimizer", "adam_beta2", type=float)
    _flag(g, "--adam-eps", "optimizer", "adam_eps", type=float)
    _flag(g, "--sgd-momentum", "optimizer", "sgd_momentum", type=float)
    _flag(g, "--muon-momentum", "optimizer", "muon_momentum", type=float,
          help="Muon's momentum, in [0, 1) (default 0.95)")
    g.add_argument("--muon-use-nesterov", action=argparse.BooleanOptionalAction, default=None,
                   help="Nesterov momentum in Muon's update (default on, as torch.optim.Muon)")
    _FIELDS.append(("--muon-use-nesterov", "optimizer", "muon_use_nesterov"))
    _flag(g, "--muon-num-ns-steps", "optimizer", "muon_num_ns_steps", type=int,
          help="Newton-Schulz iterations that orthogonalise Muon's update, 1 to 99 (default 5)")
    _flag(g, "--muon-scale-mode", "optimizer", "muon_scale_mode",
          choices=list(MUON_SCALE_MODES),
          help="Muon's learning-rate factor of an out x in matrix: sqrt(max(1, out/in)) "
               "(default; torch's 'original'), sqrt(max(out, in)), sqrt(out/in)")
    _flag(g, "--muon-extra-scale-factor", "optimizer", "muon_extra_scale_factor", type=float,
          help="times --muon-scale-mode's factor, > 0 (default 1; spectral with 0.2 matches "
               "AdamW's update RMS, torch's 'match_rms_adamw')")
    _flag(g, "--clip-grad", "optimizer", "clip_grad", type=float, help="0 disables clipping")
    _flag(g, "--lr-warmup-init", "optimizer", "lr_warmup_init", type=float,
          help="the learning rate the warm-up starts from (default 0)")
    _flag(g, "--decoupled-lr", "optimizer", "decoupled_lr", type=float,
          help="peak learning rate of the input embeddings and the output layer")
    _flag(g, "--decoupled-min-lr", "optimizer", "decoupled_min_lr", type=float,
          help="final learning rate of the input embeddings and the output layer")
    _flag(g, "--start-weight-decay", "optimizer", "start_weight_decay", type=float)
    _flag(g, "--end-weight-decay", "optimizer", "end_weight_decay", type=float)
    _flag(g, "--weight-decay-incr-style", "optimizer", "weight_decay_incr_style",
          choices=["constant", "linear", "cosine"],
          help="weight decay from --start-weight-decay to --end-weight-decay over the training")

    g = parser.add_argument_group("training")
    _flag(g, "--micro-batch-size", "training", "micro_batch_size", type=int)
    _flag(g, "--global-batch-size", "training", "global_batch_size", type=int)
    _flag(g, "--train-iters", "training", "train_iters", type=int)
    _flag(g, "--train-samples", "training", "train_samples", type=int,
          help="instead of --train-iters: train for this many samples (whole global batches)")
    _flag(g, "--eval-interval", "training", "eval_interval", type=int)
    _flag(g, "--eval-iters", "training", "eval_iters", type=int)
    _flag(g, "--log-interval", "training", "log_interval", type=int)
    _flag(g, "--seed", "training", "seed", type=int)
    _flag(g, "--exit-duration-in-mins", "training", "exit_duration_in_mins", type=float)
    _bool_flag(g, "--exit-signal-handler", "training", "exit_signal_handler",
               "save a checkpoint and exit on SIGTERM")
    _flag(g, "--exit-interval", "training", "exit_interval", type=int)
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true",
                   help="the default: a non-finite gradient norm outside fp16 stops the job")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_true",
                   help="skip such a step instead, as fp16's loss scaler does")
    _bool_flag(g, "--manual-gc", "training", "manual_gc",
               "Python's garbage collector off during training; collect at fixed points")
    _flag(g, "--manual-gc-interval", "training", "manual_gc_interval", type=int,
          help="with --manual-gc: collect every N iterations (0: only around evaluation)")
    g.add_argument("--no-manual-gc-eval", action="store_true",
                   help="with --manual-gc: no collection around evaluation")
    _flag(g, "--empty-unused-memory-level", "training", "empty_unused_memory_level", type=int,
          choices=[0, 1, 2], help="CUDA: empty the cache after each step (1), also after "
                                  "evaluation (2)")
    _bool_flag(g, "--torch-compile", "training", "torch_compile",
               "compile each transformer layer with torch.compile (every weight version of a "
               "layer shares its compiled graph)")
    _bool_flag(g, "--deterministic-mode", "training", "deterministic_mode",
               "torch.use_deterministic_algorithms(True)")
    _bool_flag(g, "--skip-train", "training", "skip_train",
               "no training: evaluate the weights (of --load) on the validation and test sets")
    _bool_flag(g, "--calculate-per-token-loss", "training", "calculate_per_token_loss",
               "GPT: the batch's loss is the mean over all of its tokens (over microbatches and "
               "replicas) instead of the mean of the microbatches' means; they differ where "
               "--eod-mask-loss leaves microbatches with unequal token counts")
    _flag(g, "--rampup-batch-size", "training", "rampup_batch_size", type=int, nargs=3,
          metavar=("START", "INCREMENT", "SAMPLES"),
          help="with --train-samples: grow the global batch from START by INCREMENT over the first "
               "SAMPLES samples, as Megatron-LM does; the pipeline drains at each change")
    _flag(g, "--step-batch-size-schedule", "training", "step_batch_size_schedule",
          metavar="'THRESHOLD:BATCH ...'",
          help="Megatron-LM's step-wise global batch: from each threshold of consumed tokens (K, M, "
               "B, T suffixes; the first 0) the batch given; --global-batch-size is the last one")

    g = parser.add_argument_group("data and tokenizer")
    _bool_flag(g, "--mock-data", "data", "mock_data", "synthetic random tokens")
    _flag(g, "--data-path", "data", "data_path", nargs="+", help="PREFIX or W1 PREFIX1 W2 PREFIX2 ...")
    _flag(g, "--train-data-path", "data", "train_data_path", nargs="+")
    _flag(g, "--valid-data-path", "data", "valid_data_path", nargs="+")
    _flag(g, "--test-data-path", "data", "test_data_path", nargs="+")
    _flag(g, "--split", "data", "split", type=str)
    _flag(g, "--data-cache-path", "data", "data_cache_path", type=str)
    _flag(g, "--num-workers", "data", "num_workers", type=int)
    _flag(g, "--tokenizer-type", "data", "tokenizer_type", type=str, choices=TOKENIZER_TYPES)
    _flag(g, "--vocab-file", "data", "vocab_file", type=str)
    _flag(g, "--merge-file", "data", "merge_file", type=str)
    _flag(g, "--tokenizer-model", "data", "tokenizer_model", type=str)
    _flag(g, "--mask-prob", "data", "mask_prob", type=float)
    _flag(g, "--short-seq-prob", "data", "short_seq_prob", type=float)
    _bool_flag(g, "--eod-mask-loss", "data", "eod_mask_loss",
               "GPT: no loss on the targets that follow an end-of-document token")
    _bool_flag(g, "--reset-position-ids", "data", "reset_position_ids",
               "GPT: positions restart at 0 after each end-of-document token")
    _bool_flag(g, "--reset-attention-mask", "data", "reset_attention_mask",
               "GPT: a token attends only to its own document within the sample")
    g.add_argument("--data-impl", choices=["mmap", "infer"], default=None,
                   help="older Megatron-LM scripts' flag; the .bin/.idx files are always read "
                        "memory-mapped")

    g = parser.add_argument_group("checkpointing")
    _flag(g, "--save", "checkpoint", "save", type=str)
    _flag(g, "--save-interval", "checkpoint", "save_interval", type=int)
    _flag(g, "--load", "checkpoint", "load", type=str)
    _bool_flag(g, "--no-load-optim", "checkpoint", "no_load_optim", "load weights only")
    _bool_flag(g, "--no-load-rng", "checkpoint", "no_load_rng", "do not restore RNG states")
    _bool_flag(g, "--finetune", "checkpoint", "finetune",
               "load weights only and start at iteration 0")
    _bool_flag(g, "--exit-on-missing-checkpoint", "checkpoint", "exit_on_missing_checkpoint",
               "stop with an error when --load holds no checkpoint (default: start from scratch)")
    _bool_flag(g, "--use-checkpoint-args", "checkpoint", "use_checkpoint_args",
               "take the model flags left unset from the --load checkpoint's configuration")
    _bool_flag(g, "--override-opt_param-scheduler", "checkpoint", "override_opt_param_scheduler",
               "on resume, the learning-rate and weight-decay schedule of these flags wins over "
               "the checkpoint's")
    _bool_flag(g, "--use-checkpoint-opt_param-scheduler", "checkpoint",
               "use_checkpoint_opt_param_scheduler",
               "on resume, the checkpoint's learning-rate and weight-decay schedule wins")
    _bool_flag(g, "--overwrite-save", "checkpoint", "overwrite_save",
               "let a run that does not --load the --save directory write over the checkpoints "
               "it holds (refused by default)")

    g = parser.add_argument_group("logging")
    _flag(g, "--tensorboard-dir", "logging", "tensorboard_dir", type=str)
    _flag(g, "--wandb-project", "logging", "wandb_project", type=str)
    _flag(g, "--wandb-exp-name", "logging", "wandb_exp_name", type=str)
    _flag(g, "--wandb-save-dir", "logging", "wandb_save_dir", type=str)
    _flag(g, "--timing-log-level", "logging", "timing_log_level", type=int, choices=[0, 1, 2])
    _flag(g, "--log-file", "logging", "log_file", type=str, help="JSON lines of the log records")
    _bool_flag(g, "--log-params-norm", "logging", "log_params_norm",
               "the L2 norm of all parameters in the log line")
    _bool_flag(g, "--log-num-zeros-in-grad", "logging", "log_num_zeros_in_grad",
               "the number of zero gradient entries in the log line")
    _flag(g, "--tensorboard-log-interval", "logging", "tensorboard_log_interval", type=int)
    _bool_flag(g, "--log-timers-to-tensorboard", "logging", "log_timers_to_tensorboard",
               "the timers' figures to TensorBoard / W&B too")
    _bool_flag(g, "--log-validation-ppl-to-tensorboard", "logging",
               "log_validation_ppl_to_tensorboard", "validation perplexity beside its loss")
    _bool_flag(g, "--profile", "logging", "profile",
               "torch.profiler trace of iterations [--profile-step-start, --profile-step-end)")
    _flag(g, "--profile-step-start", "logging", "profile_step_start", type=int)
    _flag(g, "--profile-step-end", "logging", "profile_step_end", type=int)
    _flag(g, "--profile-ranks", "logging", "profile_ranks", type=int, nargs="+",
          help="global ranks to profile (default 0)")
    _add_megatron_flags_without_fields(parser)

    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


# Megatron-LM flags that name what megatron_2bw does anyway: accepted, with what happens instead
ACCEPTED_MEGATRON_FLAGS = {
    "--log-throughput": "every log line reports tokens/s and TFLOPS",
    "--overlap-param-gather": "with --use-distributed-optimizer the new version's regions are "
                              "always gathered in the background, each waited for by the first "
                              "forward that reads it",
    "--no-create-attention-mask-in-dataloader": "the model builds its attention masks itself",
    "--no-mmap-bin-files": "the .bin files are always memory-mapped (read-only, shared)",
    "--cross-entropy-loss-fusion": "the vocabulary-parallel cross entropy is one autograd "
                                   "function",
    "--use-cpu-initialization": "weights are always drawn on the CPU from per-name seeds (in "
                                "chunks, each rank keeping its shard on its device)",
    "--add-position-embedding": "learned absolute positions are the default",
    "--use-pytorch-profiler": "--profile always runs torch.profiler",
}


# ... and flags it cannot honour: refused with the reason instead of argparse's bare message
REFUSED_MEGATRON_FLAGS = {
    "--async-save": "checkpoints are written synchronously and atomically; drop the flag",
    "--ckpt-fully-parallel-save": "each rank writes its own files already; drop the flag",
    "--ckpt-fully-parallel-load": "each rank reads its own files already; drop the flag",
    "--tp-comm-overlap": "it needs Transformer Engine's userbuffers, which megatron_2bw does not "
                         "use; drop the flag",
    "--use-torch-fsdp2": "megatron_2bw shards optimizer state with ZeRO-1 "
                         "(--use-distributed-optimizer), not FSDP",
    "--distribute-saved-activations": "use --sequence-parallel, which splits the activations "
                                      "between tensor-parallel regions over the tensor group",
}


# flags whose value decides: refused unless it asks for what megatron_2bw does
VALUED_MEGATRON_FLAGS = {
    "--num-experts": (int, None, "mixture-of-experts layers are not implemented"),
    "--ckpt-format": (str, None, "megatron_2bw writes its own atomic per-rank checkpoints "
                                 "(docs/checkpoints.md; tools/convert_checkpoint.py reshards "
                                 "them); drop the flag"),
    "--fp8-format": (str, None, "FP8 needs Transformer Engine, which megatron_2bw does not use"),
}


def _add_megatron_flags_without_fields(parser) -> None:
    g = parser.add_argument_group("Megatron-LM flags without a setting of their own")
    for flag, meaning in ACCEPTED_MEGATRON_FLAGS.items():
        g.add_argument(flag, action="store_true", help=f"accepted: {meaning}")
    for flag in REFUSED_MEGATRON_FLAGS:
        g.add_argument(flag, action="store_true", help="refused with the reason")
    for flag, (kind, accepted, _) in VALUED_MEGATRON_FLAGS.items():
        g.add_argument(flag, type=kind, default=None,
                       help="refused with the reason" if accepted is None else
                       f"only {accepted} is accepted")
    g.add_argument("--tiktoken-pattern", default=None,
                   help="accepted: only TikTokenizer reads it, and --tokenizer-type does not "
                        "offer that one")


def _refuse_megatron_flags(args: argparse.Namespace) -> None:
    for flag, reason in REFUSED_MEGATRON_FLAGS.items():
        if getattr(args, _dest(flag), False):
            raise ConfigError(f"{flag} is not supported: {reason}")
    for flag, (_, accepted, reason) in VALUED_MEGATRON_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is not None and value != accepted:
            raise ConfigError(f"{flag} {value}: {reason}")


def explicit_fields(args: argparse.Namespace) -> set[tuple[str, str]]:
    """(section, field) pairs the user set on the command line (their value is not None)."""
    return {(section, field) for flag, section, field in _FIELDS
            if getattr(args, _dest(flag)) is not None}


def config_from_args(args: argparse.Namespace, model_type: str = "gpt",
                     base: Config | None = None, require_data: bool = True) -> Config:
    """Fill a Config from parsed flags; flags left unset keep `base`'s values (or the defaults)."""
    config = Config.from_dict(base.to_dict()) if base is not None else Config()
    config.model.model_type = model_type
    for flag, section, field in _FIELDS:
        value = getattr(args, _dest(flag))
        if value is not None:
            setattr(getattr(config, section), field, value)
    if isinstance(config.training.step_batch_size_schedule, str):
        try:
            config.training.step_batch_size_schedule = parse_step_schedule(
                config.training.step_batch_size_schedule, config.model.seq_length)
        except ValueError as error:
            raise ConfigError(f"--step-batch-size-schedule: {error}") from None
    if isinstance(config.parallel.layer_split, str):
        try:
            config.parallel.layer_split = [int(x) for x in config.parallel.layer_split.split(",")]
        except ValueError:
            raise ConfigError(f"--pipeline-layer-split expects comma-separated integers, "
                              f"got {config.parallel.layer_split!r}") from None
    if isinstance(config.recompute.num_layers_per_stage, str):
        try:
            config.recompute.num_layers_per_stage = [
                int(x) for x in config.recompute.num_layers_per_stage.split(",")]
        except ValueError:
            raise ConfigError(f"--recompute-num-layers-per-stage expects comma-separated "
                              f"integers, got {config.recompute.num_layers_per_stage!r}") from None
    if getattr(args, "bert_no_binary_head", False):
        config.model.bert_binary_head = False
    if getattr(args, "recompute_activations", False):
        config.recompute.granularity = "selective"
    if getattr(args, "train_samples", None) is not None and getattr(args, "train_iters", None) \
            is not None:
        raise ConfigError("give --train-iters or --train-samples, not both")
    _legacy_megatron_flags(args, config)
    _architecture_switches(args, config.model)
    if config.model.model_type == "bert" and config.model.num_tokentypes == 0:
        config.model.num_tokentypes = 2
    # derived defaults the dataclasses compute from other fields
    if getattr(args, "ffn_hidden_size", None) is None and base is None:
        config.model.ffn_hidden_size = config.model.default_ffn_hidden_size()
    if getattr(args, "max_position_embeddings", None) is None and base is None:
        config.model.max_position_embeddings = config.model.seq_length
    validate(config, require_data)
    return config


def _legacy_megatron_flags(args: argparse.Namespace, config: Config) -> None:
    """Flags of Megatron-LM's example scripts that name what megatron_2bw does anyway, or an older
    name of one of its options; what it cannot do is refused with the reason."""
    if getattr(args, "checkpoint_activations", False):
        config.recompute.granularity, config.recompute.method = "full", "uniform"
        config.recompute.num_layers = args.checkpoint_num_layers or 1
    elif getattr(args, "checkpoint_num_layers", None) is not None:
        raise ConfigError("--checkpoint-num-layers only applies with --checkpoint-activations "
                          "(or use --recompute-num-layers)")
    backend = getattr(args, "attention_backend", None)
    if backend not in (None, "auto"):
        raise ConfigError(f"--attention-backend {backend}: megatron_2bw runs torch's "
                          f"scaled_dot_product_attention, which chooses the flash, memory-efficient "
                          f"or math kernel itself; only 'auto' is accepted")
    impl = getattr(args, "transformer_impl", None)
    if impl not in (None, "local"):
        raise ConfigError(f"--transformer-impl {impl}: megatron_2bw builds its layers from torch "
                          f"ops (Megatron-LM's 'local'), not Transformer Engine; drop the flag or "
                          f"pass local")
    _refuse_megatron_flags(args)
    if getattr(args, "no_check_for_nan_in_loss_and_grad", False):
        if getattr(args, "check_for_nan_in_loss_and_grad", False):
            raise ConfigError("give --check-for-nan-in-loss-and-grad or "
                              "--no-check-for-nan-in-loss-and-grad, not both")
        config.training.check_for_nan_in_loss_and_grad = False
    if getattr(args, "no_manual_gc_eval", False):
        config.training.manual_gc_eval = False
    if config.precision.grad_reduce_in_bf16:
        if not config.precision.bf16 or config.precision.accumulate_allreduce_grads_in_fp32:
            raise ConfigError("--grad-reduce-in-bf16 reduces the gradients in bf16: it needs "
                              "--bf16 and excludes --accumulate-allreduce-grads-in-fp32")


def _architecture_switches(args: argparse.Namespace, model) -> None:
    """Megatron-LM's switches that turn a field off or combine two flags."""
    if getattr(args, "disable_bias_linear", False):
        model.add_bias_linear = False
    if getattr(args, "use_rotary_position_embeddings", False):
        model.position_embedding_type = "rope"
    if getattr(args, "no_position_embedding", False) \
            and model.position_embedding_type == "learned_absolute":
        model.position_embedding_type = "none"
    if getattr(args, "group_query_attention", False):
        model.num_query_groups = args.num_query_groups or 1
    elif getattr(args, "num_query_groups", None) is not None:
        raise ConfigError("--num-query-groups takes effect only with --group-query-attention")


def parse_config(argv=None, model_type: str = "gpt", description: str = "",
                 extra_args_provider=None, require_data: bool = True
                 ) -> tuple[Config, argparse.Namespace]:
    parser = build_parser(description, extra_args_provider)
    args = parser.parse_args(argv)
    return config_from_args(args, model_type, require_data=require_data), args


@contextmanager
def exit_on_config_error(program: str | None = None):
    """Turn a ConfigError into one line on stderr and exit code 2 (no traceback)."""
    try:
        yield
    except ConfigError as error:
        name = program or sys.argv[0].rsplit("/", 1)[-1]
        print(f"{name}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
