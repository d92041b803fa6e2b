"""Sequence classification (or regression) on the BERT encoder, for GLUE-style fine-tuning.

The pretrained encoder (embeddings, layers, final LayerNorm) is followed, as in Megatron-LM's
`Classification` model, by the pooler (tanh of a linear map of the [CLS] position), dropout and a
linear layer to `num_classes` outputs (one output: regression, e.g. STS-B). The encoder is
tensor-parallel; pooler and classifier are small and replicated. The whole model lives on one
pipeline stage.

Parameter names follow the pretrained model's where the weights come from it: `encoder.X` is the
checkpoint's `X`, `final_norm`/`pooler` are its `heads.final_norm`/`heads.pooler`
(see `pretrained_name`); the masked-LM and sentence-order heads are not part of this model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig, RecomputeConfig
from megatron_2bw.models.bert import BertModel
from megatron_2bw.models.transformer import build_norm
from megatron_2bw.tensor_parallel.layers import ReplicatedLinear, initialize_parameters

# our parameter-name prefix -> the pretrained BERT's
PRETRAINED_PREFIXES = {"encoder.": "", "final_norm.": "heads.final_norm.",
                       "pooler.": "heads.pooler."}
# weights that may be absent from the checkpoint (no pooler when pretrained with
# --bert-no-binary-head) or are never in it: they keep their fresh initialisation
OPTIONAL_PREFIXES = ("pooler.", "classifier.")


def pretrained_name(name: str) -> str | None:
    """The checkpoint parameter that initialises `name`, or None for the new classifier."""
    for ours, theirs in PRETRAINED_PREFIXES.items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return None


class BertClassifier(nn.Module):
    def __init__(self, config: ModelConfig, group, padded_vocab_size: int, num_classes: int,
                 recompute: RecomputeConfig | None = None):
        super().__init__()
        if config.num_tokentypes < 2:
            raise ValueError(f"sentence-pair classification needs token-type embeddings "
                             f"(num_tokentypes >= 2), the model has {config.num_tokentypes}")
        self.num_classes = num_classes
        self.encoder = BertModel(config, group, padded_vocab_size, range(config.num_layers),
                                 pre_process=True, post_process=False, recompute=recompute)
        # BertModel marks a first stage's embeddings as tied to a later stage's head: not here
        self.encoder.embedding.word_embeddings.weight.spec.tied = False
        h = config.hidden_size
        self.final_norm = build_norm(config)
        self.pooler = ReplicatedLinear(h, h)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.classifier = ReplicatedLinear(h, num_classes)

    @property
    def is_regression(self) -> bool:
        return self.num_classes == 1

    def forward(self, batch: dict) -> torch.Tensor:
        """Logits [b, num_classes] in fp32 from batch text/types/padding_mask [b, s]."""
        hidden = self.final_norm(self.encoder.gather_sequence(self.encoder(None, batch)))
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        return self.classifier(self.dropout(pooled)).float()

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross entropy over the classes, or mean squared error for regression."""
        if self.is_regression:
            return F.mse_loss(logits.squeeze(-1), labels.float())
        return F.cross_entropy(logits, labels)

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """Class indices, or the predicted scores for regression."""
        return logits.squeeze(-1) if self.is_regression else logits.argmax(dim=-1)


def build_classifier(config: ModelConfig, group, tensor_parallel: int, num_classes: int, seed: int,
                     recompute: RecomputeConfig | None = None) -> BertClassifier:
    """A freshly initialised classifier (pretraining's initialisation rule: independent of t)."""
    model = BertClassifier(config, group, config.padded_vocab_size(tensor_parallel), num_classes,
                           recompute)
    initialize_parameters(model, seed, config.init_method_std, config.num_layers)
    return model
