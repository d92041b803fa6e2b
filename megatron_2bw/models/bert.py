"""BERT: bidirectional pre-LayerNorm encoder (Megatron's layout, = transformers' MegatronBert) with a
masked-LM head tied to the word embeddings and an optional sentence-order-prediction head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.transformer import LanguageModelStage, LayerNorm, build_norm
from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_2bw.tensor_parallel.layers import ReplicatedLinear, make_param, parallel_lm_logits


def padding_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] with 1 for real tokens -> boolean [b, 1, 1, s] where True means "may attend"."""
    return padding_mask.bool()[:, None, None, :]


class BertHeads(nn.Module):
    """Final norm, masked-LM transform + tied decoder with a vocabulary-parallel bias, pooler and
    binary (sentence-order) head."""

    def __init__(self, config: ModelConfig, padded_vocab_size: int, group):
        super().__init__()
        h = config.hidden_size
        self.final_norm = build_norm(config)
        self.lm_transform = ReplicatedLinear(h, h)
        self.lm_norm = LayerNorm(h, config.layernorm_epsilon, config.apply_layernorm_1p,
                                 config.memory_efficient_layer_norm)
        self.gelu_approximation = config.gelu_approximation
        self.lm_bias = make_param((padded_vocab_size,), group, 0, "zeros")
        self.binary_head = None
        if config.bert_binary_head:
            self.pooler = ReplicatedLinear(h, h)
            self.binary_head = ReplicatedLinear(h, 2)

    def forward(self, hidden, word_embeddings, group):
        hidden = self.final_norm(hidden)
        lm_hidden = self.lm_norm(F.gelu(self.lm_transform(hidden),
                                        approximate=self.gelu_approximation))
        lm_logits = parallel_lm_logits(lm_hidden, word_embeddings, group) + self.lm_bias
        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(torch.tanh(self.pooler(hidden[:, 0])))
        return lm_logits, binary_logits


class BertModel(LanguageModelStage):
    causal = False

    def build_heads(self, config: ModelConfig, padded_vocab_size: int, group) -> None:
        self.heads = BertHeads(config, padded_vocab_size, group)

    def encode(self, hidden, batch: dict):
        if self.pre_process:
            hidden = self.embedding(batch["text"], batch.get("types"))
        return self.transformer(hidden, padding_attention_mask(batch["padding_mask"]))

    def forward(self, hidden, batch: dict):
        hidden = self.encode(hidden, batch)
        if not self.post_process:
            return hidden
        lm_logits, binary_logits = self.heads(self.gather_sequence(hidden), self.head_weight(),
                                              self.group)
        labels, loss_mask = batch["labels"], batch["loss_mask"].float()
        losses = vocab_parallel_cross_entropy(lm_logits, labels.clamp(min=0), self.group,
                                              self.config.vocab_size)
        lm_loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
        metrics = {"lm loss": lm_loss.detach()}
        loss = lm_loss
        if binary_logits is not None:
            sop_loss = F.cross_entropy(binary_logits.float(), batch["is_random"].view(-1))
            metrics["sop loss"] = sop_loss.detach()
            loss = lm_loss + sop_loss
        return loss, metrics
