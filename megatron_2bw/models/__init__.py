"""Model registry: build the module of one pipeline stage for a model type."""
from __future__ import annotations

import torch

from megatron_2bw.config import ModelConfig, RecomputeConfig
from megatron_2bw.models.bert import BertModel
from megatron_2bw.models.gpt import GPTModel
from megatron_2bw.tensor_parallel.layers import initialize_parameters

MODELS = {"gpt": GPTModel, "bert": BertModel}


def build_stage_model(config: ModelConfig, group, tensor_parallel: int, layers: range,
                      pre_process: bool, post_process: bool, seed: int,
                      recompute: RecomputeConfig | None = None, context_group=None,
                      device: torch.device | str | None = None):
    """The stage's module with Megatron's initialisation (independent of the parallel layout).
    `context_group`: the ranks splitting each sequence (GPT's context parallelism). `device`:
    where the weights are allocated and initialised, shard by shard (default: the CPU)."""
    if config.model_type not in MODELS:
        raise ValueError(f"unknown model type {config.model_type!r}; expected one of {list(MODELS)}")
    with torch.device(device or "cpu"):
        model = MODELS[config.model_type](config, group, config.padded_vocab_size(tensor_parallel),
                                          layers, pre_process, post_process, recompute,
                                          context_group)
    initialize_parameters(model, seed, config.init_method_std, config.num_layers)
    return model
