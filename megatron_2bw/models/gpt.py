"""GPT: pre-norm decoder with causal attention: GPT-2's layout by default (LayerNorm, GELU, learned
positions, embeddings tied to the head), Llama's with the RMSNorm, SwiGLU, rotary, grouped-query
and untied-head flags.

One class serves every pipeline stage: the first stage owns the embeddings, the last the final norm,
the head and the loss; in between a stage holds its range of layers. With p = 1 it is the whole model.
"""
from __future__ import annotations

import torch

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.context_parallel import context_split
from megatron_2bw.models.transformer import LanguageModelStage, build_norm
from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_2bw.tensor_parallel.layers import parallel_lm_logits
from megatron_2bw.tensor_parallel.mappings import gather_from_tensor_parallel


def document_causal_mask(document_ids):
    """[b, 1, s, s], True where query i may attend key j: j <= i, within i's document
    (--reset-attention-mask)."""
    s = document_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    return (causal & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]


class GPTModel(LanguageModelStage):
    causal = True

    def build_heads(self, config: ModelConfig, padded_vocab_size: int, group) -> None:
        self.final_norm = build_norm(config)

    def forward(self, hidden, batch: dict):
        tokens = batch["tokens"]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        position_ids, documents = batch.get("position_ids"), batch.get("document_ids")
        mask = None if documents is None else document_causal_mask(documents)
        split = None
        if self.context_group is not None:  # this rank's part of each sequence
            split = context_split(inputs.shape[1], self.context_group, inputs.device)
            inputs, labels = split.local(inputs), split.local(labels)
            position_ids = split.queries[None] if position_ids is None else split.local(position_ids)
            mask = split.ring(documents)
        if self.pre_process:
            hidden = self.embedding(inputs, position_ids=position_ids)
        hidden = self.transformer(hidden, mask, position_ids)
        if not self.post_process:
            return hidden
        logits = self.lm_logits(hidden)
        losses = vocab_parallel_cross_entropy(logits, labels, self.group, self.config.vocab_size)
        loss_mask = batch.get("loss_mask")
        if split is not None:
            loss = split.loss(losses, loss_mask)
        elif loss_mask is None:
            loss = losses.mean()
        else:
            loss_mask = loss_mask.to(losses.dtype)
            loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
        return loss, {"lm loss": loss.detach()}

    @staticmethod
    def loss_tokens(batch: dict) -> torch.Tensor:
        """The number of targets the microbatch's loss is the mean of (--calculate-per-token-loss
        weights the microbatches by it)."""
        loss_mask = batch.get("loss_mask")
        if loss_mask is None:
            labels = batch["tokens"][:, 1:]
            return torch.full((), float(labels.numel()), device=labels.device)  # no copy
        return loss_mask.sum(dtype=torch.float32)

    def lm_logits(self, hidden):
        """Vocabulary-parallel logits [b, s, vocab/t] of the last layer's output."""
        hidden = self.final_norm(self.gather_sequence(hidden))
        return parallel_lm_logits(hidden, self.head_weight(), self.group)

    def logits(self, tokens):
        """Full-vocabulary logits of a whole (p = 1) model, for evaluation and export checks."""
        logits = self.lm_logits(self.transformer(self.embedding(tokens)))
        return gather_from_tensor_parallel(logits, self.group)[..., :self.config.vocab_size]
