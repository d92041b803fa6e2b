"""Shared pieces of the checkpoint tests: tiny pretraining flags, random models written as
checkpoints, and evaluation of a loaded checkpoint on fixed tokens."""
from __future__ import annotations

import json

import torch

from megatron_2bw.arguments import parse_config
from megatron_2bw.checkpoint import load_checkpoint
from megatron_2bw.checkpoint.reshard import (FullState, load_full_weights, merge_shards,
                                             write_full_state)
from megatron_2bw.config import Config, DataConfig, ModelConfig
from megatron_2bw.data.mock import MockGPTDataset
from megatron_2bw.models import build_stage_model
from tests.pipeline.harness import stage_on_rank

VOCAB = 101  # padded to 104 (t=1) or 112 (t=2) with --make-vocab-size-divisible-by 8


def pretrain_flags(t: int, p: int, train_iters: int, *extra: str) -> list[str]:
    """A tiny GPT on mock data, dropout on (so exact resume needs the RNG states); batches of 8
    (later flags win: "--global-batch-size", "4" in `extra` halves them)."""
    return ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p),
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(train_iters), "--lr", "1e-3", "--lr-warmup-iters", "1",
            "--lr-decay-style", "cosine", "--optimizer", "adam", "--hidden-dropout", "0.1",
            "--attention-dropout", "0.1", "--mock-data", "--vocab-size", str(VOCAB),
            "--make-vocab-size-divisible-by", "8", "--log-interval", "1", "--eval-interval", "1000",
            "--eval-iters", "1", "--distributed-timeout-minutes", "1", *extra]


def config_from_flags(flags: list[str]) -> Config:
    return parse_config(flags)[0]


def logged_losses(path) -> list[tuple[int, float]]:
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return [(r["iteration"], r["lm loss"]) for r in records if "lm loss" in r]


def random_model_state(model_type: str, iteration: int = 7, num_layers: int = 2,
                       vocab_size: int = VOCAB, data: DataConfig | None = None,
                       **model_fields) -> FullState:
    """An unsharded model with every parameter random (so swapped or untransposed weights show),
    by default of a --mock-data run (token ids are the text; eod = VOCAB - 1); `model_fields`
    set further ModelConfig fields (e.g. Llama's switches)."""
    model = ModelConfig(model_type=model_type, num_layers=num_layers, hidden_size=32,
                        num_attention_heads=4, seq_length=16, vocab_size=vocab_size,
                        make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
                        num_tokentypes=2 if model_type == "bert" else 0, **model_fields)
    module = build_stage_model(model, None, 1, range(num_layers), True, True, seed=3)
    generator = torch.Generator().manual_seed(11)
    weights = {name: merge_shards([torch.randn(p.shape, generator=generator) * 0.3], None, name,
                                  vocab_size) for name, p in module.named_parameters()}
    return FullState(Config(model=model, data=data or DataConfig(mock_data=True)), weights,
                     iteration)


def whole_model(state: FullState):
    """The state in a single-process module (eval mode)."""
    m = state.config.model
    module = build_stage_model(m, None, 1, range(m.num_layers), True, True, seed=0)
    load_full_weights(module, state)
    return module.eval()


def save_random_checkpoint(root, model_type: str, t: int, p: int, **kwargs) -> FullState:
    state = random_model_state(model_type, **kwargs)
    write_full_state(state, str(root), t, p)
    return state


def eval_tokens(count: int = 4, seq_length: int = 16) -> torch.Tensor:
    dataset = MockGPTDataset(count, seq_length, VOCAB, seed=5)
    return torch.stack([torch.from_numpy(dataset[i]["tokens"]) for i in range(count)])


def evaluate_checkpoint(rank: int, world: int, flags: list[str], root: str) -> float | None:
    """Build the stage of `flags`' layout, load `root` and return the mean lm loss of 2
    microbatches of fixed tokens (on the rank that holds the loss; None elsewhere)."""
    layout, stage = stage_on_rank(rank, world, config_from_flags(flags))
    load_checkpoint(stage, root)
    tokens = eval_tokens()
    sums, weight = stage.executor.evaluate(2, lambda k: {"tokens": tokens[2 * k:2 * k + 2]})
    return sums["lm loss"] / weight if layout.is_last_stage and layout.coords.tp == 0 else None
