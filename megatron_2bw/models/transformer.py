"""The transformer layers GPT and BERT share: pre-norm blocks built from tensor-parallel layers, in
GPT-2's layout by default or Llama's (RMSNorm, SwiGLU, rotary positions, grouped queries).

Parallelism enters only through the tensor-parallel layers (they receive the group handle) and,
under --sequence-parallel, the norms and dropouts that work on this rank's part of the sequence;
this file reads like a single-device model.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig, RecomputeConfig
from megatron_2bw.distributed.comm import group_size
from megatron_2bw.models.ring_attention import ring_attention
from megatron_2bw.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                 VocabParallelEmbedding, make_param,
                                                 replicated_param)
from megatron_2bw.tensor_parallel.mappings import gather_from_sequence_parallel, sequence_chunk
from megatron_2bw.tensor_parallel.random import checkpoint, get_rng_tracker

try:  # NVIDIA apex is optional (--memory-efficient-layer-norm); torch's kernels serve otherwise
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine as _apex_layer_norm
except Exception:  # noqa: BLE001 - any import failure means "no apex"
    _apex_layer_norm = None


class _Norm(nn.Module):
    """A norm's gain; under --apply-layernorm-1p (Megatron-LM's zero-centred gamma) stored as
    gain - 1 and initialised to 0, where low-precision numbers have finer steps than near 1."""

    def __init__(self, hidden_size: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = replicated_param((hidden_size,), "zeros" if zero_centered else "ones")

    def gain(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered else self.weight


class LayerNorm(_Norm):
    """torch's fused layer_norm (one kernel, which torch.compile keeps inside a layer's graph);
    with `apex` (--memory-efficient-layer-norm, refused with --torch-compile, whose graphs the
    extension would split) apex's kernel on CUDA tensors, keeping its output for the backward."""

    def __init__(self, hidden_size: int, eps: float, zero_centered: bool = False,
                 apex: bool = False):
        super().__init__(hidden_size, eps, zero_centered)
        self.bias = replicated_param((hidden_size,), "zeros")
        self.apex = apex

    def forward(self, x):
        if self.apex and x.is_cuda:
            return _apex_layer_norm(x, self.gain(), self.bias, self.weight.shape, self.eps, True)
        return F.layer_norm(x, self.weight.shape, self.gain(), self.bias, self.eps)


class RMSNorm(_Norm):
    """x / sqrt(mean(x^2) + eps) * gain (Llama's norm: no centring, no bias), computed in fp32:
    torch's fused rms_norm kernel where the device has one; on the CPU, where rms_norm is this
    same decomposition plus a copy of its result into a contiguous tensor, the decomposition."""

    def forward(self, x):
        if x.device.type != "cpu":
            return F.rms_norm(x, self.weight.shape, self.gain().to(x.dtype), self.eps)
        return rms_norm_in_fp32(x, self.gain(), self.eps)


def rms_norm_in_fp32(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * gain


def build_norm(config: ModelConfig, tensor_partial_grad: bool = False,
               size: int | None = None) -> nn.Module:
    """The norm --normalization names, over `size` channels (default the hidden size)."""
    size = size or config.hidden_size
    if config.normalization == "RMSNorm":
        module = RMSNorm(size, config.layernorm_epsilon, config.apply_layernorm_1p)
    else:
        module = LayerNorm(size, config.layernorm_epsilon, config.apply_layernorm_1p,
                           config.memory_efficient_layer_norm)
    mark_tensor_partial_grads(module.parameters(), tensor_partial_grad)
    return module


def uses_sequence_parallel(config: ModelConfig, group) -> bool:
    return config.sequence_ranks(group_size(group)) > 1


def mark_tensor_partial_grads(params, partial: bool) -> None:
    """Replicated parameters applied to this rank's part of the work only (its part of the
    sequence, or its heads)."""
    for param in params:
        param.spec.tensor_partial_grad = partial


class Dropout(nn.Dropout):
    """Dropout whose mask differs between tensor-parallel ranks when each holds its own part of
    the sequence (the ranks share the default generator, Megatron's convention)."""

    def __init__(self, p: float, sequence_parallel: bool):
        super().__init__(p)
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        if not self.sequence_parallel:
            return super().forward(x)
        with get_rng_tracker().fork():
            return super().forward(x)


class Embedding(nn.Module):
    """Word (vocabulary-parallel), learned position (unless rotary or none) and optional
    token-type embeddings."""

    def __init__(self, config: ModelConfig, padded_vocab_size: int, group):
        super().__init__()
        h = config.hidden_size
        self.group, self.sequence_parallel = group, uses_sequence_parallel(config, group)
        self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, h, group,
                                                      sequence_parallel=self.sequence_parallel)
        self.position_embeddings = (
            replicated_param((config.max_position_embeddings, h), "normal")
            if config.position_embedding_type == "learned_absolute" else None)
        self.tokentype_embeddings = (replicated_param((config.num_tokentypes, h), "normal")
                                     if config.num_tokentypes else None)
        mark_tensor_partial_grads([p for p in (self.position_embeddings, self.tokentype_embeddings)
                                   if p is not None], self.sequence_parallel)
        self.dropout = Dropout(config.hidden_dropout, self.sequence_parallel)

    def _lookup(self, ids, table):
        """Rows of a replicated table, for this rank's part of the sequence under
        --sequence-parallel (the word embeddings arrive split so)."""
        ids = sequence_chunk(ids, self.group) if self.sequence_parallel else ids
        return F.embedding(ids, table)

    def forward(self, ids, tokentype_ids=None, position_ids=None):
        x = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            positions = torch.arange(ids.shape[1], device=ids.device)[None] \
                if position_ids is None else position_ids
            x = x + self._lookup(positions, self.position_embeddings)
        if self.tokentype_embeddings is not None and tokentype_ids is not None:
            x = x + self._lookup(tokentype_ids, self.tokentype_embeddings)
        return self.dropout(x)


class RotaryEmbedding(nn.Module):
    """Rotary position embeddings (RoFormer; Megatron-LM's --position-embedding-type rope): the
    first `rotary_percent` of each head's channels are rotated by angles position * base^(-2i/d)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dim = int(config.head_dim * config.rotary_percent)
        self.base, self.interleaved = config.rotary_base, config.rotary_interleaved
        self.scaling_factor = config.rope_scaling_factor if config.rope_scaling else None

    def inverse_frequencies(self, device) -> torch.Tensor:
        frequencies = self.base ** -(
            torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)
        if self.scaling_factor is None:
            return frequencies
        return llama3_scaled(frequencies, self.scaling_factor)

    def forward(self, seq_length: int, position_ids=None, device=None):
        """(cos, sin), each [b or 1, 1, s, dim] in fp32, for the positions of the sequence."""
        positions = torch.arange(seq_length, device=device)[None] if position_ids is None \
            else position_ids
        angles = positions[..., None].float() * self.inverse_frequencies(positions.device)
        # channel i pairs with i + dim/2 (Megatron's and Llama's default) or with its neighbour
        angles = angles.repeat_interleave(2, dim=-1) if self.interleaved \
            else torch.cat((angles, angles), dim=-1)
        return angles.cos()[:, None], angles.sin()[:, None]


def llama3_scaled(frequencies: torch.Tensor, factor: float, low: float = 1.0, high: float = 4.0,
                  original_context: int = 8192) -> torch.Tensor:
    """Llama 3.1's frequencies (Megatron-LM's --use-rope-scaling, with its fixed constants): a
    frequency that turns more than `high` times within the original context is kept, one that
    turns less than `low` times is divided by `factor`, and in between the two are blended linearly
    in the number of turns."""
    turns = original_context * frequencies / (2 * math.pi)
    kept = ((turns - low) / (high - low)).clamp(0.0, 1.0)
    return frequencies * (kept + (1.0 - kept) / factor)


def apply_rotary(x, rotary, interleaved: bool):
    """x [b, heads, s, head_dim] with its first cos.shape[-1] channels rotated."""
    cos, sin = rotary
    dim = cos.shape[-1]
    rotated, passed = x[..., :dim], x[..., dim:]
    if interleaved:
        pairs = rotated.unflatten(-1, (-1, 2))
        half_turn = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        first, second = rotated.chunk(2, dim=-1)
        half_turn = torch.cat((-second, first), dim=-1)
    rotated = rotated * cos.to(x.dtype) + half_turn * sin.to(x.dtype)
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


class ParallelAttention(nn.Module):
    """Self-attention with query groups (and their heads) split over the tensor-parallel group.
    `layer_number` (1-based, global) is --apply-query-key-layer-scaling's coefficient. With a
    `context_group` (context parallelism) the queries, keys and values are this rank's part of
    the sequence, and the keys and values travel around the ring (models/ring_attention.py)."""

    def __init__(self, config: ModelConfig, group, causal: bool, recompute_core: bool,
                 layer_number: int = 1, context_group=None):
        super().__init__()
        self.context_group = context_group
        h, t = config.hidden_size, group_size(group)
        sequence_parallel = uses_sequence_parallel(config, group)
        self.local_heads = config.num_attention_heads // t
        self.local_groups = config.query_groups // t
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.head_dim = config.head_dim
        self.causal, self.recompute_core = causal, recompute_core
        self.rotary_interleaved = config.rotary_interleaved
        self.dropout_p = config.attention_dropout
        self.softmax_in_fp32 = config.softmax_in_fp32
        self.score_coefficient = layer_number if config.apply_query_key_layer_scaling else 1
        # rows ordered (query group, its query heads then k then v, head_dim), so a contiguous
        # shard holds whole groups; with one group per head that is (head, q/k/v, head_dim)
        self.qkv = ColumnParallelLinear(h, config.qkv_size, group,
                                        bias=config.add_bias_linear or config.add_qkv_bias,
                                        sequence_parallel=sequence_parallel)
        # --qk-layernorm: one norm per role shared by all heads, so each tensor rank's gradient
        # covers its own heads only
        self.q_norm, self.k_norm = (build_norm(config, t > 1, config.head_dim) for _ in "qk") \
            if config.qk_layernorm else (None, None)
        self.dense = RowParallelLinear(config.attention_size, h, group,
                                       bias=config.add_bias_linear, init="output",
                                       sequence_parallel=sequence_parallel)

    def project_qkv(self, x, rotary=None, mask=None):
        """q [b, local heads, s, head_dim] (the whole sequence); k and v one per query group
        where the core shares them among the group's heads (`shares_groups_in_sdpa`), else
        repeated to one per query head."""
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, self.local_groups, self.heads_per_group + 2, self.head_dim)
        q, k, v = qkv.split([self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k, v = (t.squeeze(3).transpose(1, 2) for t in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q = apply_rotary(q, rotary, self.rotary_interleaved)
            k = apply_rotary(k, rotary, self.rotary_interleaved)
        if self.heads_per_group > 1 and not shares_groups_in_sdpa(q, mask):
            k, v = (t.repeat_interleave(self.heads_per_group, dim=1) for t in (k, v))
        return q, k, v

    def core(self, q, k, v, mask):
        """Attention of q over k and v; k and v one per query group go through
        scaled_dot_product_attention's enable_gqa."""
        dropout = self.dropout_p if self.training else 0.0
        causal = self.causal and mask is None
        grouped = k.shape[1] != q.shape[1]
        # this rank's heads: independent dropout per tp rank. Without dropout nothing draws, and
        # the fork (RNG states read on the host) would split a compiled layer into four graphs
        with get_rng_tracker().fork() if dropout > 0 else nullcontext():
            if self.context_group is not None:  # `mask`: the ring's RingBlocks
                return ring_attention(q, k, v, self.context_group, mask, dropout)
            if self.softmax_in_fp32 and q.dtype != torch.float32 and not sdpa_softmax_in_fp32():
                if grouped:
                    k, v = (t.repeat_interleave(self.heads_per_group, dim=1) for t in (k, v))
                return softmax_in_fp32_attention(q, k, v, mask, causal, dropout,
                                                 self.score_coefficient)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=causal, enable_gqa=grouped)

    def forward(self, x, mask=None, rotary=None):
        q, k, v = self.project_qkv(x, rotary, mask)
        if self.recompute_core and self.training:
            context = checkpoint(self.core, q, k, v, mask)
        else:
            context = self.core(q, k, v, mask)
        return self.dense(context.transpose(1, 2).flatten(2))


def shares_groups_in_sdpa(q: torch.Tensor, mask) -> bool:
    """Whether grouped-query attention hands k and v to scaled_dot_product_attention one per
    group (enable_gqa): on CUDA without a mask, where the flash kernel reads each group's k and v
    for all its heads, with no copies. With a mask (the memory-efficient kernel, which has no
    grouped-query support) and on the CPU (whose math fallback repeats them anyway) they are
    repeated to every head first, which the planner's activation formula counts."""
    return q.is_cuda and mask is None


def sdpa_softmax_in_fp32() -> bool:
    """Whether scaled_dot_product_attention computes its softmax in fp32 for fp16/bf16 inputs:
    its fused kernels (flash, memory-efficient, cuDNN, the CPU's flash kernel) always do, and its
    math kernel does unless torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True) was set.
    Then --attention-softmax-in-fp32 and --apply-query-key-layer-scaling (whose division only
    keeps fp16 scores in range where they are materialised in fp16) keep the fused path."""
    return not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()


def softmax_in_fp32_attention(q, k, v, mask, causal: bool, dropout: float, coefficient: int = 1):
    """Megatron-LM's unfused attention under --attention-softmax-in-fp32: scores q k^T / sqrt(d)
    in the working precision (also divided by `coefficient`, the layer's number, under
    --apply-query-key-layer-scaling, so fp16 scores of deep layers stay in range), then
    multiplied back, masked and softmaxed in fp32; the probabilities return to the working
    precision for dropout and the product with v. `mask` (True: attend) as for
    scaled_dot_product_attention."""
    b, heads, s, d = q.shape
    scores = torch.baddbmm(q.new_empty(b * heads, s, k.shape[2]), q.flatten(0, 1),
                           k.flatten(0, 1).transpose(1, 2), beta=0.0,
                           alpha=1.0 / (math.sqrt(d) * coefficient))
    scores = scores.view(b, heads, s, -1).float() * coefficient
    if causal:
        mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, -10000.0)  # Megatron's fill: a masked row stays finite
    probs = F.dropout(scores.softmax(-1).to(q.dtype), dropout)
    return torch.matmul(probs, v)


class ParallelMLP(nn.Module):
    """GELU MLP (the exact erf GELU, or with --openai-gelu its tanh approximation), or with
    --swiglu silu(gate) * up, gate and up from one fused column-parallel projection whose rows
    alternate (gate, up) per unit so any contiguous shard holds both."""

    def __init__(self, config: ModelConfig, group):
        super().__init__()
        self.swiglu = config.swiglu
        self.gelu_approximation = config.gelu_approximation
        f, bias = config.ffn_hidden_size, config.add_bias_linear
        sequence_parallel = uses_sequence_parallel(config, group)
        self.fc1 = ColumnParallelLinear(config.hidden_size, 2 * f if self.swiglu else f, group,
                                        bias=bias, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(f, config.hidden_size, group, bias=bias, init="output",
                                     sequence_parallel=sequence_parallel)

    def forward(self, x):
        hidden = self.fc1(x)
        if self.swiglu:
            gate, up = hidden.unflatten(-1, (-1, 2)).unbind(-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(hidden, approximate=self.gelu_approximation))


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, group, causal: bool, recompute_core: bool = False,
                 layer_number: int = 1, context_group=None):
        super().__init__()
        sequence_parallel = uses_sequence_parallel(config, group)
        self.input_norm = build_norm(config, sequence_parallel)
        self.attention = ParallelAttention(config, group, causal, recompute_core, layer_number,
                                           context_group)
        self.post_attention_norm = build_norm(config, sequence_parallel)
        self.mlp = ParallelMLP(config, group)
        self.dropout = Dropout(config.hidden_dropout, sequence_parallel)

    def forward(self, x, mask=None, rotary=None):
        x = x + self.dropout(self.attention(self.input_norm(x), mask, rotary))
        return x + self.dropout(self.mlp(self.post_attention_norm(x)))


class TransformerStack(nn.Module):
    """The layers [first, last) of the model, keyed by their global index (names do not depend on
    the pipeline split), with Megatron's recomputation policies."""

    def __init__(self, config: ModelConfig, group, layers: range, causal: bool,
                 recompute: RecomputeConfig | None = None, context_group=None):
        super().__init__()
        recompute = recompute or RecomputeConfig()
        self.recompute = recompute
        selective = recompute.granularity == "selective"
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(config, group, causal, selective, i + 1, context_group)
            for i in layers})
        self.rotary = RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        # under --sequence-parallel a rank holds 1/t of the sequence; rotary tables cover all of it
        self.sequence_ranks = config.sequence_ranks(group_size(group))

    def _recomputed(self, position: int) -> bool:
        r = self.recompute
        if r.granularity != "full" or not self.training:
            return False
        return r.method == "uniform" or position < r.num_layers

    def forward(self, x, mask=None, position_ids=None):
        """`position_ids` [b, s] (default 0..s-1) place the tokens for rotary embeddings."""
        rotary = None if self.rotary is None else self.rotary(x.shape[1] * self.sequence_ranks,
                                                              position_ids, x.device)
        layers = list(self.layers.values())
        position = 0
        while position < len(layers):
            if not self._recomputed(position):
                x = layers[position](x, mask, rotary)
                position += 1
                continue
            # uniform: chunks of num_layers layers; block: each of the first num_layers alone
            chunk = self.recompute.num_layers if self.recompute.method == "uniform" else 1
            group = layers[position:position + chunk]
            x = checkpoint(_run_layers(group), x, mask, rotary)
            position += len(group)
        return x


def _run_layers(layers):
    def run(x, mask, rotary):
        for layer in layers:
            x = layer(x, mask, rotary)
        return x
    return run


def tied_output_embedding(padded_vocab_size: int, hidden_size: int, group) -> nn.Parameter:
    """The last stage's copy of the word embeddings (kept identical to the first stage's)."""
    weight = make_param((padded_vocab_size, hidden_size), group, 0, "normal")
    weight.spec.init_name = "embedding.word_embeddings.weight"
    weight.spec.tied = weight.spec.tied_copy = True
    return weight


class LanguageModelStage(nn.Module):
    """What every pipeline stage of GPT and BERT shares: the first stage owns the embeddings, every
    stage its range of layers, the last stage the heads (`build_heads`) and, when it is not also
    the first, a tied copy of the word embeddings for the output layer (or, untied, the output
    layer's own weights on the last stage in any case)."""

    causal: bool

    def __init__(self, config: ModelConfig, group, padded_vocab_size: int, layers: range,
                 pre_process: bool = True, post_process: bool = True,
                 recompute: RecomputeConfig | None = None, context_group=None):
        super().__init__()
        self.config, self.group, self.context_group = config, group, context_group
        self.pre_process, self.post_process = pre_process, post_process
        self._embedding_on_rank: list[nn.Module] = []  # tie_to_local_embedding
        untied = config.untie_embeddings_and_output_weights
        if pre_process:
            self.embedding = Embedding(config, padded_vocab_size, group)
            if not post_process and not untied:
                self.embedding.word_embeddings.weight.spec.tied = True
        self.transformer = TransformerStack(config, group, layers, self.causal, recompute,
                                            context_group)
        if post_process:
            self.build_heads(config, padded_vocab_size, group)
            if untied:  # the output layer's own vocabulary-parallel weights
                self.output_layer = make_param((padded_vocab_size, config.hidden_size), group, 0,
                                               "normal")
            elif not pre_process:
                self.output_embedding = tied_output_embedding(padded_vocab_size,
                                                              config.hidden_size, group)

    def build_heads(self, config: ModelConfig, padded_vocab_size: int, group) -> None:
        raise NotImplementedError

    def gather_sequence(self, hidden):
        """The whole sequence on every rank for the heads (under --sequence-parallel each rank
        holds its part; the heads' gradient arrives whole, so each rank keeps its part of it)."""
        if not uses_sequence_parallel(self.config, self.group):
            return hidden
        return gather_from_sequence_parallel(hidden, self.group, partial_grad=False)

    def head_weight(self) -> torch.Tensor:
        if self.config.untie_embeddings_and_output_weights:
            return self.output_layer
        if self._embedding_on_rank:
            return self._embedding_on_rank[0].word_embeddings.weight
        return self.embedding.word_embeddings.weight if self.pre_process else self.output_embedding

    def borrowed_parameters(self) -> list[nn.Parameter]:
        """Weights this module uses but another module on the rank holds (the tied output layer of
        a V's last chunk): a split backward's W computes their gradients too."""
        return [self.head_weight()] if self._embedding_on_rank else []

    def tie_to_local_embedding(self, embedding: nn.Module) -> None:
        """A last virtual stage on the rank of the first (a V): the output layer reads the
        embedding module's weight itself, so the tie needs no copy and no all-reduce."""
        if self.config.untie_embeddings_and_output_weights:
            return
        del self.output_embedding
        embedding.word_embeddings.weight.spec.tied = False
        self._embedding_on_rank[:] = [embedding]  # a plain list: not a submodule of this chunk

