"""GPT: pre-LayerNorm decoder, learned positions, causal attention, embeddings tied to the head.

One class serves every pipeline stage: the first stage owns the embeddings, the last the final norm,
the head and the loss; in between a stage holds its range of layers. With p = 1 it is the whole model.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_2bw.config import ModelConfig, RecomputeConfig
from megatron_2bw.models.transformer import Embedding, LayerNorm, TransformerStack
from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_2bw.tensor_parallel.layers import make_param, parallel_lm_logits
from megatron_2bw.tensor_parallel.mappings import gather_from_tensor_parallel


def tied_output_embedding(padded_vocab_size: int, hidden_size: int, group) -> nn.Parameter:
    """The last stage's copy of the word embeddings (kept identical to the first stage's)."""
    weight = make_param((padded_vocab_size, hidden_size), group, 0, "normal")
    weight.spec.init_name = "embedding.word_embeddings.weight"
    weight.spec.tied = weight.spec.tied_copy = True
    return weight


class GPTModel(nn.Module):
    causal = True

    def __init__(self, config: ModelConfig, group, padded_vocab_size: int, layers: range,
                 pre_process: bool = True, post_process: bool = True,
                 recompute: RecomputeConfig | None = None):
        super().__init__()
        self.config, self.group = config, group
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.embedding = Embedding(config, padded_vocab_size, group)
            if not post_process:
                self.embedding.word_embeddings.weight.spec.tied = True
        self.transformer = TransformerStack(config, group, layers, self.causal, recompute)
        if post_process:
            self.final_norm = LayerNorm(config.hidden_size, config.layernorm_epsilon)
            if not pre_process:
                self.output_embedding = tied_output_embedding(padded_vocab_size,
                                                              config.hidden_size, group)

    def head_weight(self) -> torch.Tensor:
        return self.embedding.word_embeddings.weight if self.pre_process else self.output_embedding

    def forward(self, hidden, batch: dict):
        tokens = batch["tokens"]
        if self.pre_process:
            hidden = self.embedding(tokens[:, :-1])
        hidden = self.transformer(hidden)
        if not self.post_process:
            return hidden
        logits = parallel_lm_logits(self.final_norm(hidden), self.head_weight(), self.group)
        losses = vocab_parallel_cross_entropy(logits, tokens[:, 1:], self.group, self.config.vocab_size)
        loss_mask = batch.get("loss_mask")
        if loss_mask is None:
            loss = losses.mean()
        else:
            loss_mask = loss_mask.to(losses.dtype)
            loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
        return loss, {"lm loss": loss.detach()}

    def logits(self, tokens):
        """Full-vocabulary logits of a whole (p = 1) model, for evaluation and export checks."""
        hidden = self.transformer(self.embedding(tokens))
        logits = parallel_lm_logits(self.final_norm(hidden), self.head_weight(), self.group)
        return gather_from_tensor_parallel(logits, self.group)[..., :self.config.vocab_size]
