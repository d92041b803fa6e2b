"""A GPT checkpoint of any layout as one process's whole model, with its tokenizer.

The shards are merged in memory (checkpoint/reshard.py), as the evaluation tools do, so a
t x p training checkpoint samples in one process without converting it first.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from megatron_2bw.arguments import ConfigError
from megatron_2bw.checkpoint.reshard import load_full_weights, read_full_state
from megatron_2bw.checkpoint.tool_config import config_with_base
from megatron_2bw.config import Config
from megatron_2bw.data.tokenizers import Tokenizer, build_tokenizer
from megatron_2bw.inference.sampling import SamplingConfig, generate
from megatron_2bw.models import build_stage_model


@dataclass
class TextModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: Config
    iteration: int

    @property
    def max_positions(self) -> int:
        return self.config.model.max_position_embeddings

    @property
    def stop_id(self) -> int | None:
        return self.tokenizer.eod if self.tokenizer.has("eod") else None

    def encode(self, prompt: str) -> list[int]:
        """The prompt's ids; an empty prompt starts from the end-of-document token."""
        ids = self.tokenizer.tokenize(prompt)
        if not ids and self.stop_id is not None:
            ids = [self.stop_id]
        if not ids:
            raise ValueError("an empty prompt needs a tokenizer with an end-of-document token")
        return ids

    def complete(self, prompt: str, tokens_to_generate: int, sampling: SamplingConfig,
                 generator: torch.Generator | None = None) -> str:
        """The prompt followed by its continuation, as text."""
        ids = self.encode(prompt)
        new = generate(self.model, ids, tokens_to_generate, sampling, self.max_positions,
                       self.stop_id, generator)
        return self.tokenizer.detokenize(ids + new)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_text_model(args: argparse.Namespace, device: torch.device | None = None,
                    show_progress: bool = True) -> TextModel:
    """The --load checkpoint's GPT in one process (t = p = 1), its weights from every shard;
    model and tokenizer flags left unset come from the checkpoint."""
    if not args.load:
        raise ConfigError("--load CHECKPOINT_DIR is required")
    state = read_full_state(args.load, getattr(args, "iteration", None), with_optimizer=False,
                            show_progress=show_progress)
    config = config_with_base(args, state.config, f"checkpoint {args.load}", checkpoint=args.load)
    if config.model.model_type != "gpt":
        raise ConfigError(f"checkpoint {args.load} holds a {config.model.model_type} model; text "
                          f"generation needs a GPT")
    for flag, size in [("--tensor-model-parallel-size", config.parallel.tensor_parallel),
                       ("--pipeline-model-parallel-size", config.parallel.pipeline_parallel),
                       ("--context-parallel-size", config.parallel.context_parallel)]:
        if size != 1:
            raise ConfigError(f"{flag} must be 1 for text generation: it runs in one process "
                              f"(any checkpoint layout loads, merged in memory)")
    tokenizer = build_tokenizer(config.data, config.model.vocab_size)
    vocab = state.config.model.vocab_size
    if tokenizer.vocab_size != vocab:
        raise ConfigError(f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} ids, the "
                          f"checkpoint's model {vocab}: give the tokenizer flags of training")
    config.model.vocab_size = vocab
    model = build_stage_model(config.model, None, 1, range(config.model.num_layers), True, True,
                              config.training.seed)
    load_full_weights(model, state)
    model = model.to(device or default_device()).eval()
    return TextModel(model, tokenizer, config, state.iteration)
