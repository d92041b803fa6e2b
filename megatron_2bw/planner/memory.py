"""Bytes one rank of a pipeline stage holds at its peak, as the runtime lays them out.

`estimate_stage_memory` is the single estimate: the planner's memory check and the runtime's
start-up log both call it. P below is the parameter count of this rank's shard of the stage (the
stage's parameters / t, vocabulary padded to a multiple of 128*t), counted from the model code
itself (built on the meta device), so it follows the model exactly.

Weights and gradients (pipeline/weights.py, pipeline/update.py; `held_bytes_per_parameter`, the
table of docs/precision_memory.md, which a test checks against the live tensors):
- a working copy per live version (2P or 4P each; 2 versions for 2BW) and the
  gradient-accumulation buffer (working precision, or 4P with fp32 gradients:
  PrecisionConfig.fp32_gradients).
- fp32 master weights 4P, except in fp32, where they are (part of) a working copy.
- fp32 master gradients 4P, except with one version and an fp32 buffer, where they are the buffer.
- optimizer state: Adam 8P, SGD with momentum 4P, Muon 4 bytes per hidden-matrix parameter (its
  momentum buffer) and AdamW's 8 for the others, plus 4P for --delay-compensation's delta
  (8P for ef: pipeline/compensation.py; with predict the master weights are separate also in fp32).
  use_distributed_optimizer divides the master weights, master gradients and optimizer state by d
  (Muon's: the most a rank's P/d elements can hold, its AdamW parameters all counted at 8).

Activations: the bytes one layer stashes per microbatch (`activation_bytes_per_layer`, measured by
measured_profile.py on the device at hand, else the analytic count below) x layers x microbatches
in flight (schedules.max_in_flight: p - r for 1F1B, m for GPipe, p on every stage for ZB-H1, whose
activations live until the weight gradient; interleaved: its warm-up + 1 microbatch-chunks of 1/v
of the stage each), plus the stage's own extras. Under
--sequence-parallel (t > 1) what lies outside the tensor-parallel regions holds s/t tokens: the
norms' stashes, the hidden-dropout masks, the stage's input and output (the pipeline messages); the
inputs the column-parallel linears save are their gathered inputs (the whole sequence, as
tensor_parallel/layers.py runs them; Megatron-LM instead saves the local part and gathers it again
in backward), and the last stage's head runs on the gathered sequence.

Workspace: the larger transient on top of that: one layer's backward (with full recomputation: one
recomputed chunk's activations) or the fp32 cross entropy on the last stage. Adam's and SGD's
step needs none (optim/optimizer.py uses fused kernels); Muon's holds its whole-matrix updates
(optim/muon.py): with the distributed optimizer the gathered fp32 flat of the shard's weights (4P),
and for the largest matrix, whole over the tensor-parallel group, its fp32 update and gathered
pieces and the bf16 Newton-Schulz iterates (MUON_STEP_BYTES per element).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch

from megatron_2bw.config import ModelConfig, ParallelConfig, PrecisionConfig, RecomputeConfig
from megatron_2bw.distributed.comm import ShardShapeGroup
from megatron_2bw.pipeline.compensation import STATE_BUFFERS
from megatron_2bw.pipeline.partition import layer_ranges, stage_recompute
from megatron_2bw.pipeline.pipemare import stage_delay
from megatron_2bw.pipeline.schedules import live_versions, max_in_flight
from megatron_2bw.planner.hardware import HardwareSpec

# per fp32 parameter: Adam's m and v, SGD momentum; Muon: per hidden-matrix parameter (AdamW's
# for the others)
OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd": 4, "muon": 4}
MUON_STEP_BYTES = 16  # fp32 update and gathered pieces, two bf16 iterates
MASK_BYTES = 1  # dropout masks are bool tensors
# PyTorch's caching allocator rounds blocks up and cannot always reuse freed ones (a pipeline stage
# frees its microbatches' activations in another order than it allocated them): plan to fill at
# most this share of what the framework can allocate.
ALLOCATOR_EFFICIENCY = 0.95


@dataclass(frozen=True)
class StageMemory:
    params: float  # one working copy + fp32 master weights (when separate)
    grads: float  # accumulation buffer + fp32 master gradients (when separate)
    optimizer: float
    versions_stash: float  # the extra working copies (2BW's second version)
    activations: float
    workspace: float

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.versions_stash + self.activations
                + self.workspace)

    def describe(self) -> str:
        parts = ", ".join(f"{f.name} {getattr(self, f.name) / 2**30:.2f}"
                          for f in dataclasses.fields(self))
        return f"{self.total / 2**30:.2f} GiB ({parts})"


@dataclass(frozen=True)
class HeldBytes:
    """Bytes per parameter one rank holds of a stage's weights and their state."""
    working: float  # the working copies, one per live version
    buffer: float  # the gradient-accumulation buffer
    master: float  # fp32 master weights held apart from the working copies
    master_grads: float  # fp32 master gradients held apart from the buffer
    optimizer: float  # the optimizer's state (and --delay-compensation's)

    @property
    def total(self) -> float:
        return self.working + self.buffer + self.master + self.master_grads + self.optimizer


def held_bytes_per_parameter(element_bytes: int, grad_bytes: int, versions: int, shards: int,
                             optimizer: str, compensation_buffers: int = 0,
                             predicted: bool = False) -> HeldBytes:
    """What WeightVersions and the optimizer hold per parameter: `versions` working copies of
    `element_bytes`, a buffer of `grad_bytes`, the master state divided by `shards` (the
    distributed optimizer's d). The master weights are a working copy in fp32 (unless
    `predicted`: weight prediction fills the versions from elsewhere); the master gradients are
    the buffer with one version and an fp32 buffer: with more, a backward of the next batch
    accumulates into the buffer before the step has read them, and they are a tensor of their
    own unless sharded (then in a free working copy, where they fit). `compensation_buffers`:
    the fp32 buffers --delay-compensation keeps per master element (compensation.STATE_BUFFERS)."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of "
                         f"{list(OPTIMIZER_STATE_BYTES)}")
    fp32 = element_bytes == 4 and grad_bytes == 4
    separate_master = not fp32 or predicted
    separate_master_grads = versions > 1 or grad_bytes != 4
    # sharded, several versions: the shard lives in the working copy that is free from a
    # batch's reduction to its step, where it fits (WeightVersions.grads_in_free_copy)
    if shards > 1 and versions > 1 and separate_master and 4 / shards <= element_bytes:
        separate_master_grads = False
    return HeldBytes(
        working=element_bytes * versions, buffer=grad_bytes,
        master=4 / shards if separate_master else 0.0,
        master_grads=4 / shards if separate_master_grads else 0.0,
        optimizer=(OPTIMIZER_STATE_BYTES[optimizer] + 4 * compensation_buffers) / shards)


def memory_limit_bytes(hardware: HardwareSpec) -> float:
    """What a stage's estimate (StageMemory.total) may reach on one device of `hardware`."""
    return hardware.usable_memory_bytes * ALLOCATOR_EFFICIENCY


def dtype_bytes(precision: PrecisionConfig) -> int:
    return 2 if precision.fp16 or precision.bf16 else 4


def grad_buffer_bytes(precision: PrecisionConfig) -> int:
    return 4 if precision.fp32_gradients else dtype_bytes(precision)


# ---------------------------------------------------------------------------------------------
# Parameter counts, from the model code

def _model_key(model: ModelConfig) -> tuple:
    return tuple(vars(model).items())


@lru_cache(maxsize=256)
def _shard_tensors(model_key: tuple, tensor_parallel: int, layers: int, pre_process: bool,
                   post_process: bool) -> tuple[tuple[int, bool, bool], ...]:
    """(elements, gradient summed over the tensor group: `ParamSpec.tensor_partial_grad`, a hidden
    matrix that Muon updates) of each parameter tensor of one rank's shard of the stage, built
    with that shard's shapes."""
    from megatron_2bw.models import MODELS  # the models import torch layers: keep import lazy
    from megatron_2bw.optim.optimizer import is_hidden_matrix
    model = ModelConfig(**dict(model_key))
    group = ShardShapeGroup(tensor_parallel) if tensor_parallel > 1 else None
    with torch.device("meta"):
        module = MODELS[model.model_type](model, group, model.padded_vocab_size(tensor_parallel),
                                          range(layers), pre_process, post_process)
    return tuple((p.numel(), p.spec.tensor_partial_grad, is_hidden_matrix(name, p))
                 for name, p in module.named_parameters())


def _count(model: ModelConfig, tensor_parallel: int, layers: int, first: bool, last: bool,
           measure) -> int:
    """`measure` of the shard's (elements, tensor-partial gradient) tensors."""
    key = _model_key(model)
    edges = measure(_shard_tensors(key, tensor_parallel, 0, first, last))
    per_layer = measure(_shard_tensors(key, tensor_parallel, 1, False, False)) - \
        measure(_shard_tensors(key, tensor_parallel, 0, False, False))
    return edges + layers * per_layer


def stage_parameters(model: ModelConfig, tensor_parallel: int, layers: int, first: bool,
                     last: bool) -> int:
    """Parameters of one rank's shard of a stage with `layers` transformer layers."""
    return _count(model, tensor_parallel, layers, first, last,
                  lambda tensors: sum(n for n, _, _ in tensors))


def stage_parameter_tensors(model: ModelConfig, tensor_parallel: int, layers: int, first: bool,
                            last: bool) -> int:
    """How many parameter tensors that shard holds (each gradient is accumulated by a kernel)."""
    return _count(model, tensor_parallel, layers, first, last, len)


def stage_tensor_partial_grad_parameters(model: ModelConfig, tensor_parallel: int, layers: int,
                                         first: bool, last: bool) -> int:
    """Parameters of that shard whose gradients are summed over the tensor-parallel group once per
    batch (tensor_parallel/layers.sum_tensor_partial_grads): under --sequence-parallel the norms,
    row-parallel biases, position and token-type tables; --qk-layernorm's norms; 0 at t = 1."""
    return _count(model, tensor_parallel, layers, first, last,
                  lambda tensors: sum(n for n, summed, _ in tensors if summed))


def stage_hidden_matrix_parameters(model: ModelConfig, tensor_parallel: int, layers: int,
                                   first: bool, last: bool) -> int:
    """Parameters of that shard in the hidden matrices Muon updates (optim/optimizer.py)."""
    return _count(model, tensor_parallel, layers, first, last,
                  lambda tensors: sum(n for n, _, matrix in tensors if matrix))


@lru_cache(maxsize=64)
def _layer_matrix_shapes(model_key: tuple) -> tuple[tuple[int, int], ...]:
    from megatron_2bw.models import MODELS
    from megatron_2bw.optim.optimizer import is_hidden_matrix
    model = ModelConfig(**dict(model_key))
    with torch.device("meta"):
        module = MODELS[model.model_type](model, None, model.padded_vocab_size(1), range(1),
                                          False, False)
    return tuple(tuple(p.shape) for name, p in module.named_parameters()
                 if is_hidden_matrix(name, p))


def layer_matrix_shapes(model: ModelConfig) -> tuple[tuple[int, int], ...]:
    """The whole (unsharded) shapes of one layer's hidden matrices, which Muon orthogonalises."""
    return _layer_matrix_shapes(_model_key(model))


def largest_hidden_matrix(model: ModelConfig, tensor_parallel: int, layers: int) -> int:
    """Elements of the shard's largest hidden matrix (0 without layers)."""
    tensors = _shard_tensors(_model_key(model), tensor_parallel, min(layers, 1), False, False)
    return max((n for n, _, matrix in tensors if matrix), default=0)


def layer_parameters(model: ModelConfig, tensor_parallel: int) -> int:
    return stage_parameters(model, tensor_parallel, 1, False, False) - \
        stage_parameters(model, tensor_parallel, 0, False, False)


# ---------------------------------------------------------------------------------------------
# Activations (analytic)

def norm_stash_bytes(model: ModelConfig, element_bytes: int, device_type: str = "cuda") -> int:
    """Bytes per element one norm keeps for its backward besides its output: its input (torch's
    fused layer_norm, and its fused rms_norm off the CPU); on a CPU RMSNorm's decomposition in
    fp32 (transformer.rms_norm_in_fp32) its input cast to fp32 and the normalised value before
    the gain."""
    if model.normalization == "RMSNorm" and device_type == "cpu":
        return 4 + element_bytes
    return element_bytes


def ffn_wide_tensors(model: ModelConfig) -> int:
    """ffn-wide tensors (f/t per token) a layer's MLP stashes, and about as many ffn-wide gradients
    are alive in its backward: GELU's input and output; SwiGLU's fused gate/up output (two wide),
    silu(gate) and the product."""
    return 4 if model.swiglu else 2


def unfused_attention(model: ModelConfig, element_bytes: int) -> bool:
    """Whether the attention core is transformer.softmax_in_fp32_attention (Megatron-LM's unfused
    attention, which keeps its s x s scores): the fp32 softmax with fp16/bf16 activations where
    scaled_dot_product_attention would not compute it in fp32 (transformer.sdpa_softmax_in_fp32);
    otherwise, and with fp32 activations, scaled_dot_product_attention."""
    from megatron_2bw.models.transformer import sdpa_softmax_in_fp32
    return model.softmax_in_fp32 and element_bytes < 4 and not sdpa_softmax_in_fp32()


def fused_attention(model: ModelConfig, element_bytes: int, device_type: str) -> bool:
    """Whether the attention core is a fused scaled_dot_product_attention kernel (flash,
    memory-efficient or cuDNN on CUDA; the CPU's flash kernel), which keeps a log-sum-exp per query
    row for its backward instead of s x s scores: on CUDA always (its fused kernels take dropout
    and masks), on the CPU only without attention dropout (with it, the math path runs). Never
    for the unfused attention of the fp32 softmax (`unfused_attention`)."""
    if unfused_attention(model, element_bytes):
        return False
    return device_type != "cpu" or model.attention_dropout == 0


def qkv_stash_bytes(model: ModelConfig, tensor_parallel: int, element_bytes: int,
                    selective: bool = False, device_type: str = "cuda") -> float:
    """Bytes per token one rank keeps of the attention's q, k and v for its backward.

    The core keeps its own copies, ad/t elements each, the width of all a query heads of d
    channels (config.attention_size; grouped-query attention repeats k and v to every query head
    first; PyTorch's math path scales q and k, the unfused path makes them batch-contiguous for
    its matmuls). Under selective recomputation the core's inputs are kept instead
    (ParallelAttention.project_qkv): each ad/t when copied (rotated, normed, repeated to every
    query head of its group, or q reshaped out of several groups); a view keeps the whole QKV
    output (qkv_size/t) alive instead.
    --qk-layernorm adds its two norms' stashes over q and k (ad/t and query_groups*d/t
    elements): `norm_stash_bytes` per element, except that a norm keeping its input as it is
    (all but the CPU's RMSNorm of fp16/bf16 inputs, which casts them to fp32) keeps views of the
    QKV output (k's, and q's unless copied out of several groups), so the whole output, counted
    once whoever else keeps it."""
    m, t, e = model, tensor_parallel, element_bytes
    width = m.attention_size  # of q, and of k and v repeated to every query head
    one_per_head = m.query_groups == m.num_attention_heads
    q_copied = not one_per_head and m.query_groups != t  # out of several local groups
    if selective:
        new_qk = m.position_embedding_type == "rope" or m.qk_layernorm
        q_view = not new_qk and not q_copied
        k_view = not new_qk and one_per_head
        copies = 3 - q_view - k_view - one_per_head  # v is a view with one group per head
        qkv_output_kept = q_view or one_per_head
    else:
        copies, qkv_output_kept = 3, False
    norms = 0.0
    if m.qk_layernorm:
        normed = width + m.query_groups * m.head_dim
        stash = norm_stash_bytes(m, e, device_type)
        if stash > e and e != 4:  # the input cast to fp32: new tensors
            norms = stash * normed
        else:
            norms = (stash - e) * normed
            copies += q_copied
            qkv_output_kept = True
    return (e * (copies * width + qkv_output_kept * m.qkv_size) + norms) / t


def attention_core_bytes(model: ModelConfig, tensor_parallel: int, micro_batch_size: int,
                         element_bytes: int, device_type: str = "cuda") -> float:
    """Bytes the attention core keeps for its backward besides q, k and v, per microbatch (one
    rank). A fused kernel (`fused_attention`) keeps an fp32 log-sum-exp per query row and head
    (its output is the dense projection's input, counted there) and the float mask it makes of
    BERT's boolean padding mask. Otherwise the core keeps per score (a*s*s/t per sample):
    PyTorch's math path the softmax output and the dropout output (e each) and the dropout mask
    (1); the unfused path (`unfused_attention`) the fp32 softmax output (4), the probabilities
    its product with v reads (e: the dropout's output, or without attention dropout the cast
    probabilities) and the dropout mask (1, with dropout) per score, and the inverted mask it
    fills the scores by (bool: s*s of GPT's causal mask, b*s of BERT's padding mask)."""
    m, e, b = model, element_bytes, micro_batch_size
    if fused_attention(m, e, device_type):
        padding_mask = e * b * m.seq_length if m.model_type == "bert" else 0
        return 4 * m.num_attention_heads * m.seq_length * b / tensor_parallel + padding_mask
    scores = m.num_attention_heads * m.seq_length ** 2 * b / tensor_parallel
    if not unfused_attention(m, e):
        return (2 * e + MASK_BYTES) * scores
    dropout_mask = MASK_BYTES if m.attention_dropout > 0 else 0
    filled = MASK_BYTES * m.seq_length * (b if m.model_type == "bert" else m.seq_length)
    return (4 + e + dropout_mask) * scores + filled


def layer_activation_bytes(model: ModelConfig, tensor_parallel: int, micro_batch_size: int,
                           element_bytes: int, selective: bool = False,
                           device_type: str = "cuda") -> float:
    """Bytes one pre-norm layer stashes for its backward per microbatch (one rank).

    Korthikanti et al. (2022) counting, generalised to an element size e and the architecture
    switches: replicated over the tensor-parallel group are the two norms' stashes
    (`norm_stash_bytes`), the inputs of the QKV and fc1 linears (e each), two hidden-dropout masks
    (1 byte each), with rotary embeddings the cos and sin tables (fp32, or copies in the working
    dtype: 8 bytes per position and rotated channel; the stage's layers share them, counted per
    layer as the measured profile counts them) and, under --apply-layernorm-1p, the gain (weight +
    1, e per channel) each norm computes; sharded are what the attention keeps of Q, K
    and V (`qkv_stash_bytes`: 3e per ad/t, ad the attention's width, a heads of d channels,
    config.attention_size: h unless --kv-channels sets d; more with --qk-layernorm's norms), the
    dense input (e per ad/t) and the MLP's `ffn_wide_tensors` (e per f/t each), and the attention
    core's own stashes (`attention_core_bytes`: per row with the fused kernels `device_type`
    runs, per score, a*s*s per sample, without them). "selective"
    recomputation drops the core's stashes and keeps its inputs.
    No bias (--disable-bias-linear) changes nothing here: bias gradients need no activation.
    --sequence-parallel (t > 1) divides the norms' stashes, the dropout masks and the QKV and fc1
    inputs by t (ColumnParallelLinear keeps its part of the sequence and gathers it again in the
    backward); the rotary tables stay whole (they cover the whole sequence).
    """
    t, e, m = tensor_parallel, element_bytes, model
    s, h, f = m.seq_length, m.hidden_size, m.ffn_hidden_size
    sb = s * micro_batch_size
    rope = m.position_embedding_type == "rope"
    rotary_tables = 8 * s * int(m.head_dim * m.rotary_percent) if rope else 0
    split = (2 * norm_stash_bytes(m, e, device_type) + 2 * MASK_BYTES + 2 * e) / \
        m.sequence_ranks(t)
    norm_channels = 2 * h + (2 * m.head_dim if m.qk_layernorm else 0)
    gains = e * norm_channels if m.apply_layernorm_1p else 0
    replicated = split * sb * h + rotary_tables + gains
    # the dense projection's input is the attention's context, attention_size wide
    sharded = qkv_stash_bytes(m, t, e, selective, device_type) * sb + \
        e * sb * (m.attention_size + ffn_wide_tensors(m) * f) / t
    core = 0.0 if selective else attention_core_bytes(m, t, micro_batch_size, e, device_type)
    return replicated + sharded + core


def layer_backward_workspace_bytes(model: ModelConfig, tensor_parallel: int, micro_batch_size: int,
                                   element_bytes: int) -> float:
    """Gradients alive during one layer's backward: the MLP's ffn-wide ones and two hidden ones
    (under --sequence-parallel the residual stream's holds s/t tokens, a column-parallel input's
    the whole sequence before its reduce-scatter)."""
    sb = model.seq_length * micro_batch_size
    hidden = 1 + 1 / model.sequence_ranks(tensor_parallel)
    return element_bytes * sb * (ffn_wide_tensors(model) * model.ffn_hidden_size / tensor_parallel
                                 + hidden * model.hidden_size)


def first_stage_extra_bytes(model: ModelConfig, micro_batch_size: int, element_bytes: int,
                            tensor_parallel: int = 1) -> float:
    """Embedding: token ids (int64) and the embedding-dropout mask (s/t tokens under
    --sequence-parallel)."""
    sb = model.seq_length * micro_batch_size
    return 8 * sb + MASK_BYTES * sb * model.hidden_size / model.sequence_ranks(tensor_parallel)


def last_stage_extra_bytes(model: ModelConfig, tensor_parallel: int, micro_batch_size: int,
                           element_bytes: int, device_type: str = "cuda") -> float:
    """Final norm's stash and output (the logits' input), the logits the vocabulary-parallel
    cross entropy keeps for its backward (in the working precision) with each token's fp32 max
    and sum, targets; BERT's LM transform adds its own two inputs. All of the whole sequence:
    under --sequence-parallel the last stage gathers it first."""
    sb = model.seq_length * micro_batch_size
    vocab = model.padded_vocab_size(tensor_parallel) // tensor_parallel
    hidden = (norm_stash_bytes(model, element_bytes, device_type) + element_bytes) * sb * \
        model.hidden_size
    if model.model_type == "bert":
        hidden += 2 * element_bytes * sb * model.hidden_size
    return hidden + element_bytes * sb * vocab + 17 * sb


def cross_entropy_workspace_bytes(model: ModelConfig, tensor_parallel: int, micro_batch_size: int,
                                  element_bytes: int) -> float:
    """The logits' gradient in the working precision and one fp32 chunk of the loss's
    computation (tensor_parallel.cross_entropy.CHUNK_ELEMENTS logits at most)."""
    from megatron_2bw.tensor_parallel.cross_entropy import CHUNK_ELEMENTS
    vocab = model.padded_vocab_size(tensor_parallel) // tensor_parallel
    logits = model.seq_length * micro_batch_size * vocab
    return element_bytes * logits + 4 * min(logits, CHUNK_ELEMENTS)


# ---------------------------------------------------------------------------------------------
# The estimate

@lru_cache(maxsize=1024)
def _stage_layers(num_layers: int, stages: int, split: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(r) for r in layer_ranges(num_layers, stages, list(split) or None))


def _recomputed_layers(recompute: RecomputeConfig, layers: int) -> tuple[int, int, int]:
    """(layers stashing everything, checkpointed chunks, layers recomputed at once in backward)."""
    if recompute.granularity != "full":
        return layers, 0, 0
    n = max(recompute.num_layers, 1)
    if recompute.method == "block":
        checkpointed = min(n, layers)
        return layers - checkpointed, checkpointed, 1 if checkpointed else 0
    return 0, -(-layers // n), min(n, layers)


def estimate_stage_memory(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                          recompute: RecomputeConfig, optimizer: str, micro_batch_size: int,
                          microbatches: int, data_parallel: int, stage: int,
                          activation_bytes_per_layer: float | None = None,
                          device_type: str = "cuda") -> StageMemory:
    """Peak bytes on one rank of `stage`. `activation_bytes_per_layer` (measured) is what a layer
    not wrapped in full recomputation stashes per microbatch (with "selective" if configured);
    None uses the analytic `layer_activation_bytes` of the attention kernels `device_type`
    ("cuda" or "cpu") runs. A per-stage recompute plan
    (RecomputeConfig.num_layers_per_stage) counts this stage's own."""
    t, p = parallel.tensor_parallel, parallel.pipeline_parallel
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} out of range for {p} pipeline stages")
    schedule = parallel.pipeline_schedule
    recompute = stage_recompute(recompute, stage)
    layers = _stage_layers(model.num_layers, p, tuple(parallel.layer_split or ()))[stage]
    first, last = stage == 0, stage == p - 1
    if parallel.pipeline_shape == "v":  # chunks r and 2p-1-r; both ends of the model on rank 0
        ranges = layer_ranges(model.num_layers, 2 * p)
        layers = len(ranges[stage]) + len(ranges[2 * p - 1 - stage])
        first = last = stage == 0
    P = stage_parameters(model, t, layers, first, last)
    e, g = dtype_bytes(precision), grad_buffer_bytes(precision)
    versions = live_versions(schedule, p, stage)  # working copies: 2BW 2, PipeDream p - s
    shards = data_parallel if parallel.use_distributed_optimizer else 1
    compensation_buffers = STATE_BUFFERS[parallel.delay_compensation]
    held = held_bytes_per_parameter(e, g, versions, shards, optimizer,
                                    compensation_buffers=compensation_buffers,
                                    predicted=parallel.delay_compensation == "predict")
    params = (e + held.master) * P
    grads = (held.buffer + held.master_grads) * P
    optimizer_bytes = held.optimizer * P
    muon_step = 0.0
    if optimizer == "muon":
        # a rank's shard holds P / d elements, matrices' (4 bytes) or AdamW's (8 bytes): at most
        # all of the AdamW parameters, as the flat layout may give them to one rank
        adamw = P - stage_hidden_matrix_parameters(model, t, layers, first, last)
        state = OPTIMIZER_STATE_BYTES["muon"] * P / shards + (
            OPTIMIZER_STATE_BYTES["adam"] - OPTIMIZER_STATE_BYTES["muon"]) * min(adamw, P / shards)
        optimizer_bytes = state + 4 * compensation_buffers * P / shards
        muon_step = (4 * P if shards > 1 else 0) + \
            MUON_STEP_BYTES * t * largest_hidden_matrix(model, t, layers)
    stash = (held.working - e) * P
    if schedule == "pipemare" and parallel.pipemare_discrepancy_decay > 0 and \
            stage_delay(microbatches, stage, p) >= 1:
        stash += 4 * P  # T2's delta in place of a stash: fp32, whole on every replica

    b = micro_batch_size
    if activation_bytes_per_layer is None:
        activation_bytes_per_layer = layer_activation_bytes(
            model, t, b, e, selective=recompute.granularity == "selective",
            device_type=device_type)
    full_layers, chunks, recomputed_at_once = _recomputed_layers(recompute, layers)
    # a layer's input, the stage's output: s/t tokens under --sequence-parallel
    layer_input = e * model.seq_length * b * model.hidden_size / model.sequence_ranks(t)
    per_microbatch = full_layers * activation_bytes_per_layer + chunks * layer_input
    if first:
        per_microbatch += first_stage_extra_bytes(model, b, e, t)
    if last:
        per_microbatch += last_stage_extra_bytes(model, t, b, e, device_type)
    else:
        per_microbatch += layer_input  # the stage output, kept for its backward
    # interleaved: microbatch-chunks in flight, each chunk 1/v of the stage's layers
    model_chunks = parallel.model_chunks
    in_flight = max_in_flight(schedule, p, microbatches, stage, model_chunks) / model_chunks
    activations = in_flight * per_microbatch

    workspace = max(
        layer_backward_workspace_bytes(model, t, b, e)
        + recomputed_at_once * activation_bytes_per_layer,
        cross_entropy_workspace_bytes(model, t, b, e) if last else 0.0, muon_step)
    return StageMemory(params, grads, optimizer_bytes, stash, activations, workspace)
