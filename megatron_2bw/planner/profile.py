"""How long the model's pieces take on one rank, and how many bytes a layer stashes: per
(tensor-parallel size t, micro batch size b), without any communication (cost.py adds that).

Two sources with one interface (`costs(t, b) -> ComputeCosts`): `AnalyticProfile`
(analytic_profile.py), for hardware not at hand, and `MeasuredProfile` (measured_profile.py),
on the device at hand. The model FLOP counts here are shared with the log's throughput figures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from megatron_2bw.config import ModelConfig


@dataclass(frozen=True)
class ComputeCosts:
    """One rank, one microbatch; seconds without communication, bytes per microbatch."""
    layer_forward_s: float
    layer_backward_s: float  # with the weight-gradient accumulation
    attention_core_forward_s: float  # what "selective" recomputation repeats
    embedding_forward_s: float
    embedding_backward_s: float
    head_forward_s: float  # final norm, logits, loss
    head_backward_s: float
    layer_activation_bytes: float  # stashed by a layer without recomputation
    selective_layer_activation_bytes: float  # with the attention core recomputed
    # CPU ranks: how much more processor time a layer's forward and backward take while two
    # ranks take turns on each processor than with a processor each (each turn starts on caches
    # the other rank filled); measured where a job puts more ranks on a node than it has
    # processors (measure_turn_taking), else 0
    turn_taking_overhead: float = 0.0

    def activation_bytes_per_layer(self, granularity: str | None) -> float:
        """What a layer not wrapped in full recomputation stashes (memory.estimate_stage_memory)."""
        return self.selective_layer_activation_bytes if granularity == "selective" \
            else self.layer_activation_bytes


class Profile(Protocol):
    def costs(self, tensor_parallel: int, micro_batch_size: int) -> ComputeCosts: ...


def linear_flops_per_token(model: ModelConfig) -> float:
    """Forward matmul FLOPs of a whole layer's four linears per token: 2h(q + ad + f1 + f), q the
    QKV projection's output features, ad the dense projection's input (a heads of d channels,
    config.attention_size), f1 fc1's (2f with SwiGLU); 24h^2 in GPT-2's layout."""
    m = model
    fc1 = 2 * m.ffn_hidden_size if m.swiglu else m.ffn_hidden_size
    return 2 * m.hidden_size * (m.qkv_size + m.attention_size + fc1 + m.ffn_hidden_size)


def attention_flops_per_token(model: ModelConfig) -> float:
    """Forward matmul FLOPs of a layer's attention scores and their product with V per token:
    4sad over the a heads of d channels (config.attention_size; 4sh in GPT-2's layout)."""
    return 4 * model.seq_length * model.attention_size
