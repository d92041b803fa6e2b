"""The transformer layers GPT and BERT share: pre-LayerNorm blocks built from tensor-parallel layers.

Parallelism enters only through the tensor-parallel layers (they receive the group handle); this file
reads like a single-device model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig, RecomputeConfig
from megatron_2bw.distributed.comm import group_size
from megatron_2bw.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                 VocabParallelEmbedding, make_param,
                                                 replicated_param)
from megatron_2bw.tensor_parallel.random import checkpoint, get_rng_tracker

try:  # NVIDIA apex is optional; torch's layer_norm computes the same function
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine as _apex_layer_norm
except Exception:  # noqa: BLE001 - any import failure means "no apex"
    _apex_layer_norm = None


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = replicated_param((hidden_size,), "ones")
        self.bias = replicated_param((hidden_size,), "zeros")

    def forward(self, x):
        if _apex_layer_norm is not None and x.is_cuda:
            return _apex_layer_norm(x, self.weight, self.bias, self.weight.shape, self.eps)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Embedding(nn.Module):
    """Word (vocabulary-parallel), learned position and optional token-type embeddings."""

    def __init__(self, config: ModelConfig, padded_vocab_size: int, group):
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, h, group)
        self.position_embeddings = replicated_param((config.max_position_embeddings, h), "normal")
        self.tokentype_embeddings = (replicated_param((config.num_tokentypes, h), "normal")
                                     if config.num_tokentypes else None)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, ids, tokentype_ids=None, position_ids=None):
        positions = torch.arange(ids.shape[1], device=ids.device) if position_ids is None \
            else position_ids
        x = self.word_embeddings(ids) + F.embedding(positions, self.position_embeddings)
        if self.tokentype_embeddings is not None and tokentype_ids is not None:
            x = x + F.embedding(tokentype_ids, self.tokentype_embeddings)
        return self.dropout(x)


class ParallelAttention(nn.Module):
    """Self-attention with heads split over the tensor-parallel group."""

    def __init__(self, config: ModelConfig, group, causal: bool, recompute_core: bool):
        super().__init__()
        h = config.hidden_size
        self.local_heads = config.num_attention_heads // group_size(group)
        self.head_dim = config.head_dim
        self.causal, self.recompute_core = causal, recompute_core
        self.dropout_p = config.attention_dropout
        # rows ordered (head, q/k/v, head_dim) so a contiguous shard holds whole heads
        self.qkv = ColumnParallelLinear(h, 3 * h, group)
        self.dense = RowParallelLinear(h, h, group, init="output")

    def core(self, q, k, v, mask):
        dropout = self.dropout_p if self.training else 0.0
        with get_rng_tracker().fork():  # this rank's heads: independent dropout per tp rank
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=self.causal and mask is None)

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        if self.recompute_core and self.training:
            context = checkpoint(self.core, q, k, v, mask)
        else:
            context = self.core(q, k, v, mask)
        return self.dense(context.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class ParallelMLP(nn.Module):
    def __init__(self, config: ModelConfig, group):
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, group)
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, group, init="output")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, group, causal: bool, recompute_core: bool = False):
        super().__init__()
        self.input_norm = LayerNorm(config.hidden_size, config.layernorm_epsilon)
        self.attention = ParallelAttention(config, group, causal, recompute_core)
        self.post_attention_norm = LayerNorm(config.hidden_size, config.layernorm_epsilon)
        self.mlp = ParallelMLP(config, group)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x, mask=None):
        x = x + self.dropout(self.attention(self.input_norm(x), mask))
        return x + self.dropout(self.mlp(self.post_attention_norm(x)))


class TransformerStack(nn.Module):
    """The layers [first, last) of the model, keyed by their global index (names do not depend on
    the pipeline split), with Megatron's recomputation policies."""

    def __init__(self, config: ModelConfig, group, layers: range, causal: bool,
                 recompute: RecomputeConfig | None = None):
        super().__init__()
        recompute = recompute or RecomputeConfig()
        self.recompute = recompute
        selective = recompute.granularity == "selective"
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, group, causal, selective)
                                     for i in layers})

    def _recomputed(self, position: int) -> bool:
        r = self.recompute
        if r.granularity != "full" or not self.training:
            return False
        return r.method == "uniform" or position < r.num_layers

    def forward(self, x, mask=None):
        layers = list(self.layers.values())
        position = 0
        while position < len(layers):
            if not self._recomputed(position):
                x = layers[position](x, mask)
                position += 1
                continue
            # uniform: chunks of num_layers layers; block: each of the first num_layers alone
            chunk = self.recompute.num_layers if self.recompute.method == "uniform" else 1
            group = layers[position:position + chunk]
            x = checkpoint(_run_layers(group), x, mask)
            position += len(group)
        return x


def _run_layers(layers):
    def run(x, mask):
        for layer in layers:
            x = layer(x, mask)
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
                 recompute: RecomputeConfig | None = None):
        super().__init__()
        self.config, self.group = config, group
        self.pre_process, self.post_process = pre_process, post_process
        untied = config.untie_embeddings_and_output_weights
        if pre_process:
            self.embedding = Embedding(config, padded_vocab_size, group)
            if not post_process and not untied:
                self.embedding.word_embeddings.weight.spec.tied = True
        self.transformer = TransformerStack(config, group, layers, self.causal, recompute)
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

    def head_weight(self) -> torch.Tensor:
        if self.config.untie_embeddings_and_output_weights:
            return self.output_layer
        return self.embedding.word_embeddings.weight if self.pre_process else self.output_embedding

