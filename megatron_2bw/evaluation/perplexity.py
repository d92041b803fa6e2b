"""Zero-shot evaluation of a GPT: token-level perplexity and LAMBADA last-word accuracy.

Every protocol becomes a list of `Window`s, L + 1 tokens (inputs tokens[:-1], targets tokens[1:])
with a mask of the targets that count, so one scoring loop serves them all:
- full windows (default): the token stream cut into non-overlapping windows; window i reads tokens
  i*L .. i*L+L-1 and predicts i*L+1 .. i*L+L; a last partial window is dropped.
- overlapping windows (Megatron-LM's WikiText-103 protocol, --overlapping-eval K): window i starts
  at token i*K and counts only its last K targets (the first window counts all of them), so every
  target after the first L is predicted with at least L-K tokens of context and each target is
  counted exactly once; the last window is padded.
- LAMBADA: one window per passage, counting only the last word's tokens; a passage is correct when
  every one of them is the argmax prediction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_2bw.distributed.comm import all_reduce
from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_2bw.tensor_parallel.mappings import gather_from_tensor_parallel


@dataclass
class Window:
    tokens: np.ndarray  # [L + 1] int64
    loss_mask: np.ndarray  # [L] float32: 1 where the target counts


# -- windows -----------------------------------------------------------------------------------------

def full_windows(tokens: np.ndarray, seq_length: int) -> list[Window]:
    count = (len(tokens) - 1) // seq_length
    return [Window(np.asarray(tokens[i * seq_length:(i + 1) * seq_length + 1], dtype=np.int64),
                   np.ones(seq_length, dtype=np.float32)) for i in range(count)]


def overlapping_windows(tokens: np.ndarray, seq_length: int, stride: int,
                        pad_id: int) -> list[Window]:
    if not 1 <= stride <= seq_length:
        raise ValueError(f"--overlapping-eval {stride} must be between 1 and --seq-length "
                         f"{seq_length}")
    targets = len(tokens) - 1
    count = max(math.ceil(max(targets - stride, 0) / stride) + 1, 1)
    windows = []
    for i in range(count):
        chunk = np.asarray(tokens[i * stride:i * stride + seq_length + 1], dtype=np.int64)
        mask = np.zeros(seq_length, dtype=np.float32)
        mask[:len(chunk) - 1] = 1.0
        if i > 0:
            mask[:seq_length - stride] = 0.0  # predicted by an earlier window already
        padded = np.full(seq_length + 1, pad_id, dtype=np.int64)
        padded[:len(chunk)] = chunk
        windows.append(Window(padded, mask))
    return windows


def lambada_example(text: str, tokenizer, strict: bool) -> tuple[list[int], list[int]]:
    """(context, target) token ids: the last token (default), or with --strict-lambada the whole
    last whitespace-separated word, tokenized on its own with its leading space."""
    if not strict:
        tokens = tokenizer.tokenize(text)
        return tokens[:-1], tokens[-1:]
    word = text.split()[-1]
    start = text.rfind(word)
    return tokenizer.tokenize(text[:start].strip()), tokenizer.tokenize(" " + word)


def lambada_windows(examples: list[tuple[list[int], list[int]]], seq_length: int,
                    pad_id: int) -> tuple[list[Window], int]:
    """One window per passage (contexts longer than the window lose their first tokens);
    returns the windows and how many passages were cut."""
    windows, truncated = [], 0
    for context, target in examples:
        if not target:
            raise ValueError("a LAMBADA passage has an empty last word")
        tokens = list(context) + list(target)
        if len(tokens) > seq_length + 1:
            tokens, truncated = tokens[-(seq_length + 1):], truncated + 1
        mask = np.zeros(seq_length, dtype=np.float32)
        mask[len(tokens) - 1 - len(target):len(tokens) - 1] = 1.0
        padded = np.full(seq_length + 1, pad_id, dtype=np.int64)
        padded[:len(tokens)] = tokens
        windows.append(Window(padded, mask))
    return windows, truncated


# -- scoring -----------------------------------------------------------------------------------------

def token_scores(model, tokens: torch.Tensor, with_predictions: bool):
    """Per-target losses [b, L] (and argmax predictions) of a whole-model (p = 1) GPT whose
    vocabulary may be split over its tensor-parallel group."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model.lm_logits(model.transformer(model.embedding(inputs)))
    losses = vocab_parallel_cross_entropy(logits, targets, model.group, model.config.vocab_size)
    predictions = None
    if with_predictions:
        full = gather_from_tensor_parallel(logits, model.group)[..., :model.config.vocab_size]
        predictions = full.argmax(dim=-1)
    return losses, predictions


@dataclass
class Totals:
    loss: float = 0.0  # summed over counted targets (nats)
    targets: int = 0
    correct_windows: int = 0  # windows whose counted targets are all argmax predictions
    windows: int = 0


@torch.no_grad()
def score_windows(model, windows: list[Window], micro_batch_size: int, device: torch.device,
                  data_rank: int = 0, data_size: int = 1, data_group=None,
                  with_predictions: bool = False, show_progress: bool = True) -> Totals:
    """Sum losses and hits over the windows; data-parallel replicas take every data_size-th window
    and the totals are summed over data_group."""
    model.eval()
    mine = windows[data_rank::data_size]
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # NCCL reduces device tensors
    batches = range(0, len(mine), micro_batch_size)
    for start in tqdm(batches, desc="evaluating", unit="batch", disable=not show_progress):
        chunk = mine[start:start + micro_batch_size]
        tokens = torch.from_numpy(np.stack([w.tokens for w in chunk])).to(device)
        mask = torch.from_numpy(np.stack([w.loss_mask for w in chunk])).to(device)
        losses, predictions = token_scores(model, tokens, with_predictions)
        sums[0] += (losses.double() * mask).sum().item()
        sums[1] += mask.sum().item()
        if predictions is not None:
            hit = (predictions == tokens[:, 1:]) | (mask == 0)
            sums[2] += hit.all(dim=1).sum().item()
        sums[3] += len(chunk)
    all_reduce(sums, data_group, op=dist.ReduceOp.SUM)
    return Totals(sums[0].item(), int(sums[1].item()), int(sums[2].item()), int(sums[3].item()))


def perplexity_report(totals: Totals, seq_length: int, stride: int | None,
                      tokens_per_word: float | None = None) -> dict:
    loss = totals.loss / max(totals.targets, 1)
    report = {"task": "perplexity", "seq_length": seq_length,
              "protocol": ("non-overlapping full windows" if stride is None
                           else f"overlapping windows, stride {stride}"),
              "windows": totals.windows, "targets": totals.targets, "loss": loss,
              "perplexity": _exp(loss)}
    if tokens_per_word is not None:
        # Megatron's adjusted perplexity: per word of the original text rather than per token
        report.update(token_ratio=tokens_per_word, adjusted_perplexity=_exp(loss * tokens_per_word))
    return report


def lambada_report(totals: Totals, strict: bool, truncated: int) -> dict:
    return {"task": "lambada", "strict": strict, "examples": totals.windows,
            "correct": totals.correct_windows,
            "accuracy": totals.correct_windows / max(totals.windows, 1),
            "truncated_contexts": truncated}


def _exp(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
