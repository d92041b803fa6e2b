"""--mock-data: deterministic random tokens, in the same sample formats as the real datasets.

Sample i is drawn from a generator seeded by (seed, i) alone, so it is the same whatever the
number of ranks or the order of access.
"""
from __future__ import annotations

import numpy as np

from megatron_2bw.data.bert_dataset import BertSampleSettings, make_bert_sample
from megatron_2bw.data.gpt_dataset import seeded_rng


class MockGPTDataset:
    """`dataset[i] -> {"tokens": int64 [seq_length + 1]}`: an arithmetic progression of token ids
    (modulo the vocabulary) with a random start and a random step in [1, 16].

    Random but learnable: the next token follows from the previous two, so a model's loss visibly
    falls (uniform random tokens would sit at ln(vocab) from the first step and show nothing)."""

    MAX_STEP = 16

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        if vocab_size <= 0:
            raise ValueError(f"--mock-data needs --vocab-size N > 0, got {vocab_size}")
        self.num_samples, self.seq_length, self.vocab_size, self.seed = (
            num_samples, seq_length, vocab_size, seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = seeded_rng(self.seed, index)
        start = rng.randint(0, self.vocab_size)
        step = rng.randint(1, self.MAX_STEP + 1)
        positions = np.arange(self.seq_length + 1, dtype=np.int64)
        return {"tokens": (start + step * positions) % self.vocab_size}


class MockBERTDataset:
    """BERT samples built from random "sentences" of non-special ids, masked like real data."""

    def __init__(self, num_samples: int, settings: BertSampleSettings, seed: int):
        special = settings.special
        self.ordinary_ids = np.setdiff1d(np.arange(settings.vocab_size),
                                         [special.cls, special.sep, special.mask, special.pad])
        if len(self.ordinary_ids) == 0:
            raise ValueError(f"--vocab-size {settings.vocab_size} leaves no ordinary token ids "
                             f"beside the special ones")
        self.num_samples, self.settings, self.seed = num_samples, settings, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = seeded_rng(self.seed, index)
        sentence_count = 2 + rng.randint(0, 4)
        sizes = np.maximum(1, rng.multinomial(self.settings.max_tokens,
                                              [1 / sentence_count] * sentence_count))
        sentences = [self.ordinary_ids[rng.randint(0, len(self.ordinary_ids), size=n)]
                     for n in sizes]
        return make_bert_sample(sentences, self.settings.max_tokens, self.settings, rng)
