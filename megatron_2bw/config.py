"""Typed configuration: one dataclass per concern, assembled into `Config`.

`arguments.py` turns Megatron-compatible flags into a `Config`; library code only ever sees these
dataclasses (no global args object).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the flag and what was expected."""


@dataclass
class ModelConfig:
    model_type: str = "gpt"  # "gpt" or "bert"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    seq_length: int = 64
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 0  # the tokenizer's vocabulary, before padding
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    # Llama-style architecture switches (Megatron-LM's flags); the defaults are GPT-2/BERT's
    normalization: str = "LayerNorm"  # "LayerNorm" | "RMSNorm"
    add_bias_linear: bool = True  # False: --disable-bias-linear (every linear layer of the layers)
    add_qkv_bias: bool = False  # the qkv projection keeps its bias under --disable-bias-linear
    swiglu: bool = False  # gated SiLU MLP; fc1 rows ordered (ffn unit, gate/up)
    openai_gelu: bool = False  # GELU's tanh approximation (GPT-2's own; transformers' gelu_new)
    position_embedding_type: str = "learned_absolute"  # | "rope" | "none"
    rotary_percent: float = 1.0  # share of each head's channels that rotary embeddings rotate
    rotary_base: float = 10000.0
    rotary_interleaved: bool = False  # rotate channel pairs (2i, 2i+1) instead of (i, i + d/2)
    rope_scaling: bool = False  # Llama 3.1's long-context frequencies (--use-rope-scaling)
    rope_scaling_factor: float = 8.0
    num_query_groups: int | None = None  # grouped-query attention; None: one group per head
    kv_channels: int | None = None  # the head size (--kv-channels); None: hidden_size / heads
    qk_layernorm: bool = False  # a norm (--normalization's) over each head's queries and keys
    apply_layernorm_1p: bool = False  # every norm's weight holds gain - 1 (zero-centred gamma)
    # LayerNorm through apex's fused kernel that keeps its output instead of its input for the
    # backward (Megatron-LM's flag; needs NVIDIA apex, on CUDA tensors); otherwise torch's kernels
    memory_efficient_layer_norm: bool = False
    # numerics under fp16/bf16 (not the architecture): scores in the working precision, softmax in
    # fp32; layer scaling also divides the scores by the layer's number until the softmax (and so,
    # as in Megatron-LM, implies the fp32 softmax)
    attention_softmax_in_fp32: bool = False
    apply_query_key_layer_scaling: bool = False
    # activations outside the tensor-parallel regions split along the sequence over the tensor
    # group (--sequence-parallel; Megatron-LM's TransformerConfig holds it too). Not part of the
    # architecture: a checkpoint loads with it on or off.
    sequence_parallel: bool = False
    # GPT only: the output layer's own weights instead of the word embeddings' (Megatron-LM's flag)
    untie_embeddings_and_output_weights: bool = False
    # BERT only
    bert_binary_head: bool = True
    num_tokentypes: int = 0

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = self.default_ffn_hidden_size()
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    def default_ffn_hidden_size(self) -> int:
        """Megatron-LM's rule: 4h, or with SwiGLU two thirds of it (as many MLP weights in three
        matrices as in two) rounded down to a multiple of 64."""
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64
        return 4 * self.hidden_size

    @property
    def gelu_approximation(self) -> str:
        """F.gelu's `approximate`: "tanh" under --openai-gelu (the MLP's and BERT's LM head's)."""
        return "tanh" if self.openai_gelu else "none"

    @property
    def softmax_in_fp32(self) -> bool:
        """--attention-softmax-in-fp32, or --apply-query-key-layer-scaling, which implies it."""
        return self.attention_softmax_in_fp32 or self.apply_query_key_layer_scaling

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_size(self) -> int:
        """Channels of all query heads (and of the attention's output before its projection)."""
        return self.num_attention_heads * self.head_dim

    def sequence_ranks(self, tensor_parallel: int) -> int:
        """How many parts a rank's activations outside the tensor-parallel regions are split into
        along the sequence: t under --sequence-parallel, else 1."""
        return tensor_parallel if self.sequence_parallel else 1

    @property
    def query_groups(self) -> int:
        """Key/value heads: each serves num_attention_heads / query_groups query heads."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_size(self) -> int:
        """Output features of the fused qkv projection."""
        return self.attention_size + 2 * self.query_groups * self.head_dim

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron's rule: pad to a multiple of make_vocab_size_divisible_by * t."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1  # cp ranks split each sequence (GPT); part of the data-parallel ranks
    schedule: str | None = None  # see pipeline/schedules.SCHEDULES; None picks 2bw when p > 1
    vertical_sync: bool = False  # pipedream: every stage reads the first stage's version
    # interleaved: model chunks per rank (v), or the layers of each chunk (v = layers / p / this)
    virtual_pipeline_parallel: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    layer_split: list[int] | None = None  # layers per stage
    distributed_backend: str | None = None  # None: nccl with CUDA, gloo otherwise
    timeout_minutes: float = 10.0
    auto_parallel: bool = False
    planner_hardware: str = "local"  # --auto-parallel: YAML file, shipped name or "local"
    planner_profile_cache: str | None = None
    use_distributed_optimizer: bool = False
    ddp_bucket_size: int = 40_000_000  # elements per data-parallel all-reduce bucket
    # start each bucket's all-reduce during the batch's last backward (pipeline/overlap.py);
    # None: on GPUs (NCCL runs it beside the compute), off on CPUs (gloo's threads would take
    # the cores the backward computes on)
    overlap_grad_reduce: bool | None = None
    bind_cores_to_rank: bool = False  # each local rank on its own share of the node's cores
    # online repartitioning (pipeline/repartition.py): every N iterations the stages' measured
    # per-layer times choose a new layer split and recompute plan; moved if the predicted gain
    # reaches min_gain (a fraction)
    repartition_interval: int | None = None
    repartition_min_gain: float = 0.05
    # asynchronous schedules: "none" | "predict" | "dc" | "ef" | "nesterov"
    # (pipeline/compensation.py)
    delay_compensation: str = "none"
    # dc's lambda, ef's beta, nesterov's gamma; None: the mode's DEFAULT_COEFFICIENT
    delay_compensation_lambda: float | None = None
    # PipeMare (pipeline/pipemare.py): T1's K (0: off) and T2's D (0: off; 0 <= D < 1)
    pipemare_lr_warmup_iters: int = 0
    pipemare_discrepancy_decay: float = 0.0

    @property
    def pipeline_schedule(self) -> str:
        if self.schedule is not None:
            return "pipedream-vs" if self.schedule == "pipedream" and self.vertical_sync \
                else self.schedule
        if self.virtual_pipeline_parallel or self.num_layers_per_virtual_pipeline_stage:
            return "interleaved"  # as Megatron-LM: the virtual-stage flags select it
        return "2bw" if self.pipeline_parallel > 1 else "flush"

    @property
    def model_chunks(self) -> int:
        """Model chunks per rank: v under interleaved (validated), 2 under a V, else 1."""
        if self.pipeline_schedule == "interleaved":
            return self.virtual_pipeline_parallel or 1
        return 2 if self.pipeline_shape == "v" else 1

    @property
    def pipeline_shape(self) -> str:
        """Where the model chunks sit (pipeline/placement.py): "v" for the V schedules."""
        from megatron_2bw.pipeline.schedule_registry import REGISTRY  # config sits below it
        spec = REGISTRY.get(self.pipeline_schedule)
        return spec.shape if spec is not None else "loop"


@dataclass
class PrecisionConfig:
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # static scale; None means dynamic (fp16)
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    accumulate_allreduce_grads_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False  # --bf16 only: opt out of fp32 gradients (Megatron-LM's)

    @property
    def fp32_gradients(self) -> bool:
        """Whether gradients are accumulated and reduced in fp32: with
        --accumulate-allreduce-grads-in-fp32, and under --bf16 unless --grad-reduce-in-bf16
        (Megatron-LM's defaults: bf16 gradients lose too much when summed over microbatches and
        replicas; fp16's, loss-scaled, stay in fp16 unless asked)."""
        return self.accumulate_allreduce_grads_in_fp32 or (self.bf16
                                                           and not self.grad_reduce_in_bf16)

    @property
    def working_dtype_name(self) -> str:
        return "float16" if self.fp16 else "bfloat16" if self.bf16 else "float32"


@dataclass
class RecomputeConfig:
    granularity: str | None = None  # None | "full" | "selective"
    method: str | None = None  # "uniform" | "block" (full only)
    num_layers: int = 1
    # per pipeline stage: how many of the stage's first layers recompute in full (vPipe-style
    # plans; pipeline/partition.stage_recompute gives each stage its own setting)
    num_layers_per_stage: list[int] | None = None


MUON_SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")  # optim/muon.update_scale


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"  # "adam" (AdamW) | "sgd" | "muon" (optim/muon.py; AdamW for the rest)
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0  # with TrainingConfig.train_samples
    lr_warmup_fraction: float | None = None  # of the decay, instead of the two above
    lr_decay_style: str = "linear"  # constant | linear | cosine
    lr_decay_iters: int | None = None  # default train_iters
    lr_decay_samples: int | None = None  # with train_samples; default train_samples
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    # Muon (Megatron-Core's flag names; torch.optim.Muon's defaults)
    muon_momentum: float = 0.95
    muon_use_nesterov: bool = True
    muon_num_ns_steps: int = 5
    muon_scale_mode: str = "shape_scaling"  # shape_scaling | spectral | unit_rms_norm
    muon_extra_scale_factor: float = 1.0
    clip_grad: float = 1.0
    lr_warmup_init: float = 0.0  # the warm-up rises from this rate (Megatron-LM's flag)
    # the input embeddings' and output layer's own peak and final rate (None: --lr, --min-lr)
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    # weight decay from start to end over the training (None: --weight-decay throughout)
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"  # constant | linear | cosine


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # default micro * d
    # Megatron-LM's START INCREMENT SAMPLES: the batch grows to global_batch_size (batch_schedule.py)
    rampup_batch_size: list[int] | None = None
    # Megatron-LM's "THRESHOLD:BATCH ..." (tokens), held as [[threshold in samples, batch], ...]
    step_batch_size_schedule: list[list[int]] | str | None = None
    train_iters: int = 100
    train_samples: int | None = None  # instead of train_iters: train_samples // global batch
    eval_interval: int = 1000
    eval_iters: int = 10
    log_interval: int = 10
    seed: int = 1234
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    exit_interval: int | None = None
    # a non-finite loss or gradient norm outside fp16 stops the job (fp16 skips the step instead)
    check_for_nan_in_loss_and_grad: bool = True
    manual_gc: bool = False  # Python's collector off; collect every manual_gc_interval iterations
    manual_gc_interval: int = 0  # 0: only around evaluation (manual_gc_eval)
    manual_gc_eval: bool = True
    empty_unused_memory_level: int = 0  # CUDA: 1 empty the cache after each step, 2 also after eval
    deterministic_mode: bool = False  # torch.use_deterministic_algorithms
    skip_train: bool = False  # evaluate the (loaded) weights on the validation and test sets only
    # GPT: the batch's loss is the mean over all its tokens, not the mean of microbatch means
    calculate_per_token_loss: bool = False
    torch_compile: bool = False  # torch.compile each transformer layer (models/compile.py)


@dataclass
class DataConfig:
    mock_data: bool = False
    data_path: list[str] | None = None  # [weight, prefix, weight, prefix, ...] or [prefix]
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    split: str = "969,30,1"
    data_cache_path: str | None = None
    num_workers: int = 0
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    # GPT, from the end-of-document tokens (Megatron-LM's flags; data/gpt_dataset.py)
    eod_mask_loss: bool = False  # no loss on the targets after an end-of-document token
    reset_position_ids: bool = False  # positions restart after each one
    reset_attention_mask: bool = False  # attention stays within a document

    @property
    def uses_document_boundaries(self) -> bool:
        return self.eod_mask_loss or self.reset_position_ids or self.reset_attention_mask


@dataclass
class CheckpointConfig:
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    exit_on_missing_checkpoint: bool = False  # an empty --load is an error, not a fresh start
    use_checkpoint_args: bool = False  # the model flags left unset come from --load's checkpoint
    # a resumed run whose lr/wd schedule differs from the checkpoint's: which one wins (Megatron-LM)
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    overwrite_save: bool = False  # a fresh run may write over the checkpoints --save holds


@dataclass
class LoggingConfig:
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    timing_log_level: int = 0
    log_file: str | None = None  # JSON lines of the log records, for tools/plot_logs.py
    log_memory: bool = True
    log_params_norm: bool = False  # the L2 norm of all parameters, in the log line
    log_num_zeros_in_grad: bool = False  # zero entries of the gradient, in the log line
    tensorboard_log_interval: int = 1  # iterations between TensorBoard / W&B records
    log_timers_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    # torch.profiler over iterations [profile_step_start, profile_step_end) on profile_ranks
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Config":
        """Inverse of to_dict; unknown keys (from older checkpoints) are ignored."""
        defaults = cls()
        kwargs = {}
        for f in dataclasses.fields(cls):
            section_cls = type(getattr(defaults, f.name))
            known = {x.name for x in dataclasses.fields(section_cls)}
            given = values.get(f.name, {})
            kwargs[f.name] = section_cls(**{k: v for k, v in given.items() if k in known})
        return cls(**kwargs)
