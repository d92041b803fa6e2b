"""Checks of a Config, each failing with one line that names the flags (ConfigError): `validate`
needs only the config, `validate_for_world` also the number of processes (it derives d and the
microbatches per batch)."""
from __future__ import annotations

from megatron_2bw.batch_schedule import batch_schedule
from megatron_2bw.config import MUON_SCALE_MODES, Config, ConfigError, OptimizerConfig


def _validate_schedule_units(tr, opt) -> None:
    """Megatron-LM's rule: a run counts in iterations (--train-iters, --lr-decay-iters,
    --lr-warmup-iters) or in samples (--train-samples, --lr-decay-samples, --lr-warmup-samples);
    --lr-warmup-fraction goes with either."""
    if tr.train_samples is None:
        _require(opt.lr_decay_samples is None and opt.lr_warmup_samples == 0,
                 "--lr-decay-samples and --lr-warmup-samples go with --train-samples; with "
                 "--train-iters use --lr-decay-iters and --lr-warmup-iters")
        warmup_flag, warmup = "--lr-warmup-iters", opt.lr_warmup_iters
    else:
        _require(tr.train_samples > 0,
                 f"--train-samples must be a positive integer, got {tr.train_samples}")
        _require(opt.lr_decay_iters is None and opt.lr_warmup_iters == 0,
                 "with --train-samples give the schedule in samples (--lr-decay-samples, "
                 "--lr-warmup-samples) or --lr-warmup-fraction, not --lr-decay-iters or "
                 "--lr-warmup-iters")
        warmup_flag, warmup = "--lr-warmup-samples", opt.lr_warmup_samples
    if opt.lr_warmup_fraction is not None:
        _require(warmup == 0, f"give --lr-warmup-fraction or {warmup_flag}, not both")
        _require(0.0 <= opt.lr_warmup_fraction <= 1.0,
                 f"--lr-warmup-fraction must be in [0, 1], got {opt.lr_warmup_fraction}")


def _validate_batch_schedule(tr) -> None:
    """Megatron-LM's rules for --rampup-batch-size and --step-batch-size-schedule (the world-size
    ones: validate_for_world)."""
    steps = tr.step_batch_size_schedule
    if steps:
        _require(not tr.rampup_batch_size, "give --rampup-batch-size or --step-batch-size-schedule, "
                                           "not both")
        last = steps[-1][1]
        _require(tr.global_batch_size in (None, last),
                 f"--global-batch-size {tr.global_batch_size} differs from the last batch of "
                 f"--step-batch-size-schedule, {last}; drop it or make them equal")
        tr.global_batch_size = last
    if not tr.rampup_batch_size:
        return
    start, increment, samples = tr.rampup_batch_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    _require(tr.global_batch_size is not None, f"{flag} ramps up to --global-batch-size: give it")
    _require(start > 0 and increment > 0 and samples >= 0,
             f"{flag}: START and INCREMENT must be positive and SAMPLES >= 0")
    _require(start <= tr.global_batch_size and (tr.global_batch_size - start) % increment == 0,
             f"{flag}: --global-batch-size {tr.global_batch_size} must be START plus a whole "
             f"number of INCREMENTs")


def _validate_megatron_schedules(opt) -> None:
    """Megatron-LM's rules for --lr-warmup-init, the decoupled rates and the weight decay's."""
    _require(opt.lr_warmup_init >= 0, f"--lr-warmup-init must be >= 0, got {opt.lr_warmup_init}")
    _require(opt.decoupled_min_lr is None or opt.decoupled_lr is not None,
             "--decoupled-min-lr needs --decoupled-lr")
    for flag, value in [("--decoupled-lr", opt.decoupled_lr),
                        ("--decoupled-min-lr", opt.decoupled_min_lr)]:
        _require(value is None or value >= 0, f"{flag} must be >= 0, got {value}")
    given = [opt.start_weight_decay is not None, opt.end_weight_decay is not None]
    if opt.weight_decay_incr_style == "constant":
        _require(not any(given), "--start-weight-decay and --end-weight-decay go with "
                                 "--weight-decay-incr-style linear or cosine (constant uses "
                                 "--weight-decay)")
    else:
        _require(all(given), f"--weight-decay-incr-style {opt.weight_decay_incr_style} needs "
                             f"--start-weight-decay and --end-weight-decay")
        _require(opt.start_weight_decay >= 0 and opt.end_weight_decay >= 0,
                 "--start-weight-decay and --end-weight-decay must be >= 0")


MUON_FLAGS = {"muon_momentum": "--muon-momentum", "muon_use_nesterov": "--muon-use-nesterov",
              "muon_num_ns_steps": "--muon-num-ns-steps", "muon_scale_mode": "--muon-scale-mode",
              "muon_extra_scale_factor": "--muon-extra-scale-factor"}


def _validate_muon(opt) -> None:
    """Muon's settings need --optimizer muon and a value in range (the Adam flags stay valid:
    they set the AdamW of the other parameters)."""
    if opt.optimizer != "muon":
        default = OptimizerConfig()
        for field, flag in MUON_FLAGS.items():
            _require(getattr(opt, field) == getattr(default, field),
                     f"{flag} applies to --optimizer muon only (this run uses --optimizer "
                     f"{opt.optimizer})")
        return
    _require(0.0 <= opt.muon_momentum < 1.0,
             f"--muon-momentum must be in [0, 1), got {opt.muon_momentum}")
    _require(isinstance(opt.muon_num_ns_steps, int) and 1 <= opt.muon_num_ns_steps < 100,
             f"--muon-num-ns-steps must be an integer from 1 to 99, got {opt.muon_num_ns_steps}")
    _require(opt.muon_scale_mode in MUON_SCALE_MODES,
             f"--muon-scale-mode must be one of {', '.join(MUON_SCALE_MODES)}, got "
             f"{opt.muon_scale_mode!r}")
    _require(opt.muon_extra_scale_factor > 0,
             f"--muon-extra-scale-factor must be > 0, got {opt.muon_extra_scale_factor}")


def _validate_run_loop(tr, log) -> None:
    _require(tr.manual_gc_interval >= 0,
             f"--manual-gc-interval must be >= 0 (0: only around evaluation), got "
             f"{tr.manual_gc_interval}")
    _require(log.tensorboard_log_interval > 0, f"--tensorboard-log-interval must be a positive "
                                               f"integer, got {log.tensorboard_log_interval}")
    if log.profile:
        _require(0 <= log.profile_step_start < log.profile_step_end,
                 f"--profile-step-start {log.profile_step_start} must be >= 0 and below "
                 f"--profile-step-end {log.profile_step_end}")


def _validate_stage_plans(config: Config) -> None:
    """--pipeline-layer-split's stages against --recompute-num-layers-per-stage and the
    repartitioning flags."""
    from megatron_2bw.pipeline.partition import layer_ranges
    par, recompute = config.parallel, config.recompute
    _require(par.repartition_interval is None or par.repartition_interval >= 1,
             f"--pipeline-repartition-interval must be a positive integer, got "
             f"{par.repartition_interval}")
    _require(par.repartition_min_gain >= 0, f"--pipeline-repartition-min-gain must be >= 0, got "
                                            f"{par.repartition_min_gain}")
    _require(not (par.repartition_interval and par.schedule == "pipedream"
                  and not par.vertical_sync),
             "--pipeline-repartition-interval with --pipeline-schedule pipedream needs "
             "--vertical-sync: without it a layer's staleness depends on its stage, and a layer "
             "moved to an earlier stage would need older weight versions than its stage kept")
    plan = recompute.num_layers_per_stage
    if plan is None:
        return
    text, p = ",".join(map(str, plan)), par.pipeline_parallel
    _require(len(plan) == p, f"--recompute-num-layers-per-stage {text} gives {len(plan)} stages, "
                             f"--pipeline-model-parallel-size is {p}")
    _require(recompute.granularity in (None, "full") and recompute.method in (None, "block"),
             f"--recompute-num-layers-per-stage recomputes whole layers (full, block); it "
             f"excludes --recompute-granularity {recompute.granularity} --recompute-method "
             f"{recompute.method}")
    layers = [len(r) for r in layer_ranges(config.model.num_layers, p, par.layer_split)]
    bad = [s for s, (k, n) in enumerate(zip(plan, layers)) if not 0 <= k <= n]
    _require(not bad, f"--recompute-num-layers-per-stage {text}: stage {bad[0] if bad else 0} "
                      f"holds {layers[bad[0]] if bad else 0} layers (split "
                      f"{','.join(map(str, layers))}); give 0..that many")


def _validate_architecture(m, t: int) -> None:
    groups = m.query_groups
    _require(0 < groups <= m.num_attention_heads and m.num_attention_heads % groups == 0,
             f"--num-query-groups {groups} must divide --num-attention-heads "
             f"{m.num_attention_heads}")
    _require(groups % t == 0,
             f"--tensor-model-parallel-size {t} must divide the query groups ({groups}, "
             f"--num-query-groups): each rank holds whole groups")
    _require(m.normalization in ("LayerNorm", "RMSNorm"),
             f"--normalization expects LayerNorm or RMSNorm, got {m.normalization!r}")
    _require(not (m.openai_gelu and m.swiglu),
             "--openai-gelu approximates the GELU MLP's activation; --swiglu's MLP has none: give "
             "one of them")
    _require(m.position_embedding_type in ("learned_absolute", "rope", "none"),
             f"--position-embedding-type expects learned_absolute, rope or none, got "
             f"{m.position_embedding_type!r}")
    if m.position_embedding_type == "rope":
        rotated = int(m.head_dim * m.rotary_percent)
        _require(0 < m.rotary_percent <= 1 and rotated >= 2 and rotated % 2 == 0,
                 f"--rotary-percent {m.rotary_percent} of the head size {m.head_dim} must rotate "
                 f"a positive even number of channels (got {rotated})")
        _require(m.rotary_base > 0, f"--rotary-base must be > 0, got {m.rotary_base}")
        _require(m.rope_scaling_factor >= 1,
                 f"--rope-scaling-factor must be >= 1, got {m.rope_scaling_factor}")
    else:
        _require(not m.rope_scaling, "--use-rope-scaling needs --position-embedding-type rope")


def _validate_apex_norm(m, torch_compile: bool) -> None:
    if not m.memory_efficient_layer_norm:
        return
    from megatron_2bw.models.transformer import _apex_layer_norm
    _require(_apex_layer_norm is not None,
             "--memory-efficient-layer-norm runs NVIDIA apex's fused LayerNorm, but apex "
             "(apex.normalization) does not import here: drop the flag or install apex")
    _require(m.normalization == "LayerNorm",
             f"--memory-efficient-layer-norm applies to --normalization LayerNorm, got "
             f"{m.normalization} (RMSNorm runs torch's fused rms_norm)")
    _require(not torch_compile,
             "--memory-efficient-layer-norm's apex kernel would split each compiled layer's graph: "
             "drop it or --torch-compile (torch's layer_norm compiles into the graph)")


def _validate_context_parallel(config: Config) -> None:
    cp, m = config.parallel.context_parallel, config.model
    if cp == 1:
        return
    _require(m.model_type == "gpt", f"--context-parallel-size {cp}: context parallelism applies "
                                    f"to GPT pretraining only (BERT's attention is bidirectional "
                                    f"over padded sequences)")
    _require(m.seq_length % (2 * cp) == 0,
             f"--context-parallel-size {cp} cuts each sequence into 2 x {cp} chunks (two per rank, "
             f"for balanced causal work): --seq-length {m.seq_length} must be divisible by "
             f"{2 * cp}")
    _require(not config.parallel.auto_parallel,
             f"--auto-parallel plans without context parallelism: drop --context-parallel-size "
             f"{cp} or --auto-parallel")


def _validate_pipedream(config: Config) -> None:
    """What PipeDream's per-stage versions cannot compose with."""
    par, m, prec = config.parallel, config.model, config.precision
    if par.vertical_sync:
        _require(par.schedule == "pipedream", f"--vertical-sync applies to --pipeline-schedule "
                                              f"pipedream only, got {par.pipeline_schedule}")
    if par.schedule != "pipedream" or par.pipeline_parallel == 1:
        return
    _require(m.untie_embeddings_and_output_weights and m.model_type == "gpt",
             "--pipeline-schedule pipedream needs --untie-embeddings-and-output-weights (GPT): "
             "the first and last stage would read different versions of the tied word embeddings")
    if not par.vertical_sync:
        _require(not (prec.fp16 and prec.loss_scale is None),
                 "--pipeline-schedule pipedream --fp16 needs a static --loss-scale or "
                 "--vertical-sync: without vertical sync each stage decides its steps alone, so "
                 "a dynamic loss scale would differ between the stages")


def _validate_pipemare(config: Config) -> None:
    """PipeMare's T1/T2 flags, and what one weight version per stage cannot compose with."""
    par, prec, tr, recompute = config.parallel, config.precision, config.training, config.recompute
    schedule, k, decay = par.pipeline_schedule, par.pipemare_lr_warmup_iters, par.pipemare_discrepancy_decay
    for flag, value in [("--pipemare-lr-warmup-iters", k), ("--pipemare-discrepancy-decay", decay)]:
        _require(not value or schedule == "pipemare",
                 f"{flag} applies to --pipeline-schedule pipemare only, not to --pipeline-schedule "
                 f"{schedule}")
    _require(k >= 0, f"--pipemare-lr-warmup-iters must be >= 0 (0: T1 off), got {k}")
    _require(0.0 <= decay < 1.0,
             f"--pipemare-discrepancy-decay must be in [0, 1) (0: T2 off), got {decay}")
    if schedule != "pipemare":
        return
    _require(config.model.untie_embeddings_and_output_weights and config.model.model_type == "gpt"
             or par.pipeline_parallel == 1,
             "--pipeline-schedule pipemare needs --untie-embeddings-and-output-weights (GPT): "
             "each stage clips and steps alone, so the first and last stage's copies of the tied "
             "word embeddings would drift apart")
    _require(not (prec.fp16 and prec.loss_scale is None),
             "--pipeline-schedule pipemare --fp16 needs a static --loss-scale: each stage decides "
             "its steps alone, so a dynamic loss scale would differ between the stages")
    _require(recompute.granularity != "full" and recompute.num_layers_per_stage is None,
             "--pipeline-schedule pipemare keeps no forward-time weights, so full activation "
             "recomputation would re-run layers with newer weights: drop --recompute-granularity "
             "full (selective recomputation, which re-runs no weights, is fine)")
    _require(not (tr.rampup_batch_size or tr.step_batch_size_schedule),
             "--pipeline-schedule pipemare: the microbatches per batch set each stage's delay; "
             "drop --rampup-batch-size / --step-batch-size-schedule")
    _require(not tr.torch_compile,
             "--pipeline-schedule pipemare reads the saved weights at backward time through "
             "saved-tensor hooks, which compiled layers bypass: drop --torch-compile")
    _require(not par.repartition_interval,
             "--pipeline-repartition-interval does not apply to --pipeline-schedule pipemare "
             "(a stage's delay and T2 state belong to its layers)")


def _require(condition: bool, message: str):
    if not condition:
        raise ConfigError(message)


def _validate_virtual_stages(config: Config) -> None:
    """--pipeline-schedule interleaved and Megatron-LM's virtual-stage flags; sets v."""
    par, layers = config.parallel, config.model.num_layers
    v, per_chunk, p = (par.virtual_pipeline_parallel, par.num_layers_per_virtual_pipeline_stage,
                       par.pipeline_parallel)
    if par.pipeline_shape == "v":
        _require(v is None and per_chunk is None,
                 f"--pipeline-schedule {par.pipeline_schedule} places exactly 2 model chunks per "
                 f"rank (a V); drop --virtual-pipeline-model-parallel-size and --num-layers-per-"
                 f"virtual-pipeline-stage")
        return
    if par.pipeline_schedule != "interleaved":
        _require(v is None and per_chunk is None,
                 f"--virtual-pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-"
                 f"stage apply to --pipeline-schedule interleaved only (got "
                 f"{par.pipeline_schedule})")
        return
    _require(v is not None or per_chunk is not None,
             "--pipeline-schedule interleaved needs --virtual-pipeline-model-parallel-size V or "
             "--num-layers-per-virtual-pipeline-stage N")
    _require(p > 1, "--pipeline-schedule interleaved needs --pipeline-model-parallel-size > 1")
    _require(par.layer_split is None, "--pipeline-layer-split does not apply to --pipeline-"
                                      "schedule interleaved (its chunks split the layers evenly)")
    if per_chunk is not None:
        _require(per_chunk > 0 and layers % (p * per_chunk) == 0,
                 f"--num-layers-per-virtual-pipeline-stage {per_chunk} x --pipeline-model-"
                 f"parallel-size {p} must divide --num-layers {layers}")
        derived = layers // (p * per_chunk)
        _require(v is None or v == derived,
                 f"--virtual-pipeline-model-parallel-size {v} contradicts --num-layers-per-"
                 f"virtual-pipeline-stage {per_chunk} ({layers} layers / p {p} / {per_chunk} = "
                 f"{derived} chunks)")
        v = derived
    _require(v >= 2, f"--pipeline-schedule interleaved needs at least 2 model chunks per rank, "
                     f"got {v}")
    _require(layers % (p * v) == 0,
             f"--num-layers {layers} must be divisible by --pipeline-model-parallel-size {p} x "
             f"--virtual-pipeline-model-parallel-size {v} (equal chunks)")
    par.virtual_pipeline_parallel = v


def _validate_v_schedule(config: Config) -> None:
    """zb-v, dualpipev, v-half: 2p chunks of layers, none moved between ranks."""
    par, layers = config.parallel, config.model.num_layers
    if par.pipeline_shape != "v":
        return
    name, p = par.pipeline_schedule, par.pipeline_parallel
    _require(layers >= 2 * p, f"--pipeline-schedule {name} cuts the model into 2 x --pipeline-"
                              f"model-parallel-size = {2 * p} chunks of at least one layer: "
                              f"--num-layers must be >= {2 * p}, got {layers}")
    _require(par.layer_split is None, f"--pipeline-layer-split does not apply to --pipeline-"
                                      f"schedule {name} (its 2p chunks split the layers evenly)")
    _require(not par.repartition_interval,
             f"--pipeline-repartition-interval does not apply to --pipeline-schedule {name}: "
             f"moving layers between a V's chunks is not supported; use flush, 2bw or zb-h1")
    _require(not par.auto_parallel,
             f"--auto-parallel does not plan --pipeline-schedule {name} (its stage costs put the "
             f"output layer on the last rank, a V puts it on rank 0): drop --auto-parallel and set "
             f"the parallel sizes, or pick another schedule")


def validate(config: Config, require_data: bool = True) -> None:
    """Checks that need no knowledge of the world size."""
    m, par, tr, opt = config.model, config.parallel, config.training, config.optimizer
    for flag, value in [("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads),
                        ("--seq-length", m.seq_length), ("--micro-batch-size", tr.micro_batch_size),
                        ("--tensor-model-parallel-size", par.tensor_parallel),
                        ("--context-parallel-size", par.context_parallel),
                        ("--pipeline-model-parallel-size", par.pipeline_parallel),
                        ("--train-iters", tr.train_iters), ("--log-interval", tr.log_interval),
                        ("--eval-interval", tr.eval_interval)]:
        _require(value is not None and value > 0, f"{flag} must be a positive integer, got {value}")
    _require(tr.eval_iters is not None and tr.eval_iters >= 0,
             f"--eval-iters must be >= 0 (0: no validation), got {tr.eval_iters}")
    if m.kv_channels is None:
        _require(m.hidden_size % m.num_attention_heads == 0,
                 f"--num-attention-heads {m.num_attention_heads} must divide --hidden-size "
                 f"{m.hidden_size} (or give the head size with --kv-channels)")
    else:
        _require(m.kv_channels > 0, f"--kv-channels must be a positive integer, got "
                                    f"{m.kv_channels}")
    t = par.tensor_parallel
    _require(m.num_attention_heads % t == 0,
             f"--tensor-model-parallel-size {t} must divide --num-attention-heads "
             f"{m.num_attention_heads}")
    _require(m.hidden_size % t == 0,
             f"--tensor-model-parallel-size {t} must divide --hidden-size {m.hidden_size}")
    _require(m.ffn_hidden_size > 0,
             f"--ffn-hidden-size must be a positive integer, got {m.ffn_hidden_size} (with "
             f"--swiglu its default is 2/3 of 4 * --hidden-size rounded down to a multiple of 64)")
    _validate_architecture(m, t)
    _validate_context_parallel(config)
    _require(not m.sequence_parallel or t > 1 or par.auto_parallel,
             "--sequence-parallel splits the activations over the tensor-parallel group: it needs "
             "--tensor-model-parallel-size > 1 (got 1)")
    _validate_apex_norm(m, config.training.torch_compile)
    local_length = m.seq_length // par.context_parallel
    _require(not m.sequence_parallel or local_length % t == 0,
             f"--sequence-parallel splits --seq-length {m.seq_length} (/ --context-parallel-size "
             f"{par.context_parallel}) over --tensor-model-parallel-size {t}, which must divide "
             f"{local_length}")
    _require(m.ffn_hidden_size % t == 0,
             f"--tensor-model-parallel-size {t} must divide --ffn-hidden-size {m.ffn_hidden_size}")
    _require(m.max_position_embeddings >= m.seq_length,
             f"--max-position-embeddings {m.max_position_embeddings} must be >= --seq-length "
             f"{m.seq_length}")
    for flag, value in [("--hidden-dropout", m.hidden_dropout),
                        ("--attention-dropout", m.attention_dropout)]:
        _require(0.0 <= value < 1.0, f"{flag} must be in [0, 1), got {value}")
    p = par.pipeline_parallel
    _require(p <= m.num_layers, f"--pipeline-model-parallel-size {p} exceeds --num-layers {m.num_layers}")
    if par.layer_split is not None:
        _require(len(par.layer_split) == p and sum(par.layer_split) == m.num_layers
                 and min(par.layer_split) >= 1,
                 f"--pipeline-layer-split {','.join(map(str, par.layer_split))} must give {p} "
                 f"positive layer counts summing to --num-layers {m.num_layers}")
    _validate_virtual_stages(config)
    _validate_v_schedule(config)
    _require(not (config.precision.fp16 and config.precision.bf16), "--fp16 and --bf16 exclude each other")
    _require(opt.lr > 0 or (opt.lr == 0 and tr.skip_train),
             f"--lr must be > 0 (with a rate of 0 training changes nothing), got {opt.lr:g}")
    _require(opt.min_lr >= 0, f"--min-lr must be >= 0, got {opt.min_lr:g}")
    _validate_delay_compensation(par)
    _validate_schedule_units(tr, opt)
    _validate_batch_schedule(tr)
    _validate_megatron_schedules(opt)
    _validate_muon(opt)
    _validate_run_loop(tr, config.logging)
    _validate_pipedream(config)
    _validate_pipemare(config)
    _require(opt.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables), got {opt.clip_grad}")
    if config.recompute.granularity == "full":
        _require(config.recompute.method is not None or
                 config.recompute.num_layers_per_stage is not None,
                 "--recompute-granularity full needs --recompute-method uniform|block")
    _validate_stage_plans(config)
    _require(not m.untie_embeddings_and_output_weights or m.model_type == "gpt",
             "--untie-embeddings-and-output-weights applies to GPT only (BERT's masked-LM head "
             "stays tied)")
    _require(not config.training.calculate_per_token_loss or m.model_type == "gpt",
             "--calculate-per-token-loss applies to GPT pretraining only (BERT's sentence-order "
             "loss is a mean over samples)")
    _require(not config.data.uses_document_boundaries or m.model_type == "gpt",
             "--eod-mask-loss, --reset-position-ids and --reset-attention-mask apply to GPT "
             "pretraining only")
    if config.data.mock_data:
        _require(m.vocab_size > 0, "--mock-data needs --vocab-size N (N > 0)")
    elif require_data and config.data.data_path is None and config.data.train_data_path is None:
        raise ConfigError("give --data-path PREFIX (or --train-data-path ...) or --mock-data")


def _validate_delay_compensation(par) -> None:
    from megatron_2bw.pipeline.compensation import COMPENSATED_SCHEDULES, MODES
    mode, schedule = par.delay_compensation, par.pipeline_schedule
    _require(mode in MODES, f"--delay-compensation must be one of {', '.join(MODES)}, got {mode!r}")
    applies = COMPENSATED_SCHEDULES.get(mode, ())
    _require(mode == "none" or schedule in applies,
             f"--delay-compensation {mode} applies to --pipeline-schedule "
             f"{' or '.join(sorted({s.split('-')[0] for s in applies}))} only, not to "
             f"--pipeline-schedule {schedule}")
    lam = par.delay_compensation_lambda
    if lam is not None:
        _require(mode in ("dc", "ef", "nesterov"),
                 f"--delay-compensation-lambda applies to --delay-compensation dc, ef or nesterov "
                 f"only, got --delay-compensation {mode}")
        _require(lam >= 0, f"--delay-compensation-lambda must be >= 0, got {lam}")
        _require(mode != "nesterov" or lam < 1,
                 f"--delay-compensation-lambda (nesterov's gamma) must be < 1, got {lam}")


def validate_for_world(config: Config, world_size: int) -> int:
    """Checks that need the world size; returns the data-parallel size d (of the batch: the
    context-parallel ranks of a replica read the same samples)."""
    t, p = config.parallel.tensor_parallel, config.parallel.pipeline_parallel
    cp = config.parallel.context_parallel
    _require(world_size % (t * p * cp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size {t} x "
             f"--pipeline-model-parallel-size {p}"
             + (f" x --context-parallel-size {cp}" if cp > 1 else ""))
    d = world_size // (t * p * cp)
    tr = config.training
    if tr.global_batch_size is None:
        tr.global_batch_size = tr.micro_batch_size * d
    _require(tr.global_batch_size % (tr.micro_batch_size * d) == 0,
             f"--global-batch-size {tr.global_batch_size} must be divisible by --micro-batch-size "
             f"{tr.micro_batch_size} x data-parallel size {d}")
    m = tr.global_batch_size // (tr.micro_batch_size * d)
    if tr.rampup_batch_size:
        start, increment, _ = tr.rampup_batch_size
        _require(start % (tr.micro_batch_size * d) == 0 and increment % (tr.micro_batch_size * d)
                 == 0, f"--rampup-batch-size: START {start} and INCREMENT {increment} must be "
                       f"divisible by --micro-batch-size {tr.micro_batch_size} x data-parallel "
                       f"size {d}, so that every batch is whole microbatches on every replica")
        m = start // (tr.micro_batch_size * d)  # the smallest batch's, for the check below
    if tr.step_batch_size_schedule:
        batches = [batch for _, batch in tr.step_batch_size_schedule]
        uneven = [b for b in batches if b % (tr.micro_batch_size * d)]
        _require(not uneven, f"--step-batch-size-schedule: batch {uneven[0] if uneven else 0} is "
                             f"not divisible by --micro-batch-size {tr.micro_batch_size} x "
                             f"data-parallel size {d}")
        m = min(batches) // (tr.micro_batch_size * d)
    if tr.train_samples is not None:  # Megatron-LM's count: whole global batches after the ramp
        first = batch_schedule(tr).global_batch(0)
        growing = tr.rampup_batch_size or tr.step_batch_size_schedule
        _require(tr.train_samples >= first,
                 f"--train-samples {tr.train_samples} is less than one "
                 + (f"first global batch ({first})" if growing else f"--global-batch-size {first}"))
        tr.train_iters = batch_schedule(tr).iterations_for_samples(tr.train_samples)
    _validate_pipedream(config)  # also for configs built without the command line
    _validate_pipemare(config)
    _validate_v_schedule(config)
    schedule = config.parallel.pipeline_schedule
    if schedule == "interleaved":
        _validate_virtual_stages(config)
        _require(m % p == 0, f"--pipeline-schedule interleaved needs the microbatches per batch "
                             f"to be a multiple of --pipeline-model-parallel-size (each chunk "
                             f"takes them in groups of p): m = global/(micro*d) = {m}, p = {p}; "
                             f"make {_smallest_batch_flag(tr)} a multiple of "
                             f"{p * tr.micro_batch_size * d}")
        sizes = ([b for _, b in tr.step_batch_size_schedule] if tr.step_batch_size_schedule
                 else tr.rampup_batch_size[1:2] if tr.rampup_batch_size else [])
        uneven = [size for size in sizes if size % (p * tr.micro_batch_size * d)]
        flag = "--step-batch-size-schedule" if tr.step_batch_size_schedule else \
            "--rampup-batch-size INCREMENT"
        _require(not uneven, f"--pipeline-schedule interleaved needs every batch size to be a "
                             f"multiple of p x micro x d = {p * tr.micro_batch_size * d} (whole "
                             f"groups of p microbatches): {flag} {uneven[0] if uneven else 0} is "
                             f"not")
    if config.parallel.pipeline_shape == "v":
        from megatron_2bw.pipeline.schedule_registry import REGISTRY
        spec = REGISTRY[schedule]
        least = spec.min_microbatches(p)
        _require(m >= least, f"--pipeline-schedule {schedule} needs at least {least} microbatches "
                             f"per batch ({spec.min_microbatches_reason}): m = global/(micro*d) = "
                             f"{m}; raise {_smallest_batch_flag(tr)} to >= "
                             f"{least * tr.micro_batch_size * d}")
    if schedule in ("2bw", "flush", "zb-h1") and p > 1:
        _require(m >= p, f"--pipeline-schedule {schedule} needs at least as many microbatches per "
                         f"batch as stages (1F1B keeps p in flight): m = global/(micro*d) = {m} < "
                         f"p = {p}; raise {_smallest_batch_flag(tr)} to >= "
                         f"{p * tr.micro_batch_size * d}")
    if p > 1:  # the smallest batch's m and the final one's
        _validate_schedule_lists(config.parallel, {m, tr.global_batch_size //
                                                  (tr.micro_batch_size * d)})
    if config.logging.profile:
        outside = [r for r in config.logging.profile_ranks if not 0 <= r < world_size]
        _require(not outside, f"--profile-ranks {outside} outside the world's ranks 0.."
                              f"{world_size - 1}")
    return d


def _validate_schedule_lists(par, microbatches: set[int]) -> None:
    """The run's action lists keep every schedule rule (schedules.validate) and NCCL's
    (pipeline/nccl_replay.py): a list that breaks one is refused before the first transfer, in
    one line naming the stage, the position and the rule."""
    from megatron_2bw.pipeline import nccl_replay
    from megatron_2bw.pipeline.schedules import ScheduleError
    p = par.pipeline_parallel
    for m in sorted(microbatches):
        try:
            nccl_replay.check_schedule(par.pipeline_schedule, p, m, par.model_chunks)
        except ScheduleError as error:
            raise ConfigError(f"--pipeline-schedule {par.pipeline_schedule} with p = {p}, m = "
                              f"{m} breaks a schedule rule: {error}") from None


def _smallest_batch_flag(tr) -> str:
    if tr.rampup_batch_size:
        return "the ramp START"
    if tr.step_batch_size_schedule:
        return "every batch of --step-batch-size-schedule"
    return "--global-batch-size"


def config_warnings(config: Config) -> list[str]:
    """Legal settings that are probably mistakes: one line each, printed once before training."""
    from megatron_2bw.optim.lr_schedule import (learning_rate, schedule_iterations,
                                                training_iterations)
    opt, tr = config.optimizer, config.training
    warnings = []
    warmup, _ = schedule_iterations(opt, tr)
    run = training_iterations(tr)
    if not tr.skip_train and warmup > run:
        flag = ("--lr-warmup-fraction" if opt.lr_warmup_fraction is not None
                else "--lr-warmup-samples" if tr.train_samples is not None else "--lr-warmup-iters")
        reached = learning_rate(max(int(run) - 1, 0), opt, tr)
        warnings.append(f"warning: {flag} makes the warm-up {warmup:g} iterations, longer than "
                        f"the run's {run:g}: the learning rate ends at {reached:.3g}, never "
                        f"reaching --lr {opt.lr:g}")
    return warnings
