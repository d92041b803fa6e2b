"""Autoregressive sampling from a whole-model (p = 1) GPT: greedy, temperature, top-k, top-p.

Each new token reruns the model over the sequence so far (its last max_positions tokens): no
key/value cache, so a token costs one forward pass over the window. Meant for looking at what a
checkpoint has learned and for serving small models, not for high-throughput inference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    greedy: bool = False  # argmax at every step; the other fields are then unused
    temperature: float = 1.0
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 0.0  # keep the smallest set whose probability reaches p (0: all)

    def validate(self, names: dict[str, str] | None = None) -> None:
        """One error naming the offending setting; `names` maps a field to what the user typed
        (default: the command-line flag)."""
        names = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                 **(names or {})}
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"{names['temperature']} must be > 0 (greedy decoding takes the "
                             f"argmax), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"{names['top_k']} must be >= 0 (0: no limit), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"{names['top_p']} must be in [0, 1] (0: no limit), got {self.top_p}")
        if not self.greedy and self.top_k > 0 and self.top_p > 0:
            raise ValueError(f"give {names['top_k']} or {names['top_p']}, not both (as in "
                             f"Megatron-LM; 0 turns one off), got {self.top_k} and {self.top_p}")


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits [b, vocab] with the tokens outside the top k, then outside the nucleus of
    probability top_p, set to -inf. The most likely token is always kept."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def next_tokens(logits: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of logits [b, vocab]."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    filtered = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(filtered.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt: list[int], tokens_to_generate: int, sampling: SamplingConfig,
             max_positions: int, stop_id: int | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """The prompt's continuation (its new ids only), at most tokens_to_generate long; it ends
    early at stop_id (not included). The model sees the last max_positions tokens."""
    if not prompt:
        raise ValueError("the prompt is empty after tokenization")
    model.eval()
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(tokens_to_generate):
        logits = model.logits(tokens[:, -max_positions:])[:, -1]
        token = next_tokens(logits, sampling, generator)
        if stop_id is not None and int(token) == stop_id:
            break
        new.append(int(token))
        tokens = torch.cat([tokens, token.view(1, 1)], dim=1)
    return new
