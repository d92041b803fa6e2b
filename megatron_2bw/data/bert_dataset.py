"""BERT pretraining samples: sentence pairs with sentence-order prediction and masked tokens.

The input is a sentence-split indexed dataset (tools/preprocess_data.py --split-sentences): each
document is a run of sentence sequences. A cached sample map groups consecutive sentences of a
document until they reach a target length (the full --seq-length minus the special tokens, or with
probability --short-seq-prob a random shorter one). Each sample is then cut into segments A and B
at a random sentence boundary, swapped with probability 0.5 (is_random = 1, the sentence-order
label), truncated to the target and laid out as [CLS] A [SEP] B [SEP]. Of the non-special
tokens, --mask-prob (15%) are predicted: 80% of those become [MASK], 10% a random id and 10% stay.
Randomness for sample i comes from (seed, i) alone, so samples are reproducible in any order.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from megatron_2bw.data.gpt_dataset import seeded_rng
from megatron_2bw.data.index_cache import build_or_load, cache_directory, fingerprint
from megatron_2bw.data.indexed import IndexedDataset, bin_path

INDEX_VERSION = 1
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1  # the rest of the predicted tokens stay unchanged


@dataclass(frozen=True)
class BertSpecialTokens:
    cls: int
    sep: int
    mask: int
    pad: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "BertSpecialTokens":
        # each property raises a ValueError naming the tokenizer and the missing role
        return cls(cls=tokenizer.cls, sep=tokenizer.sep, mask=tokenizer.mask, pad=tokenizer.pad)


@dataclass(frozen=True)
class BertSampleSettings:
    seq_length: int
    vocab_size: int
    special: BertSpecialTokens
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    binary_head: bool = True  # sentence-order prediction needs two segments

    @property
    def max_tokens(self) -> int:
        """Room for the segments once [CLS] and the [SEP]s are placed."""
        return self.seq_length - (3 if self.binary_head else 2)

    @property
    def min_sentences(self) -> int:
        return 2 if self.binary_head else 1


def build_bert_sample_map(sequence_lengths: np.ndarray, document_indices: np.ndarray,
                          document_ids: np.ndarray, num_samples: int, settings: BertSampleSettings,
                          seed: int) -> np.ndarray:
    """Rows (first sentence, end sentence, target length), shuffled, at least num_samples of them."""
    lengths = sequence_lengths.tolist()
    bounds = document_indices.tolist()
    max_tokens, min_sentences = settings.max_tokens, settings.min_sentences
    samples: list[tuple[int, int, int]] = []
    epoch = 0
    while len(samples) < num_samples:
        rng = seeded_rng(seed, epoch)

        def draw_target() -> int:
            if rng.random_sample() < settings.short_seq_prob:
                return int(rng.randint(2, max_tokens + 1))
            return max_tokens

        before = len(samples)
        for document in document_ids.tolist():
            first, last = bounds[document], bounds[document + 1]
            if last - first < min_sentences:
                continue
            start, size, target = first, 0, draw_target()
            for sentence in range(first, last):
                size += lengths[sentence]
                count, remaining = sentence + 1 - start, last - sentence - 1
                # close the sample once it is long enough, unless too few sentences would be left
                if (size >= target and count >= min_sentences and remaining >= min_sentences) \
                        or remaining == 0:
                    if count >= min_sentences:
                        samples.append((start, sentence + 1, target))
                    start, size, target = sentence + 1, 0, draw_target()
        if len(samples) == before:
            raise ValueError(f"no document has {min_sentences} or more sentences: BERT data must "
                             f"be written by tools/preprocess_data.py --split-sentences")
        epoch += 1
    sample_map = np.asarray(samples, dtype=np.int64)
    return sample_map[seeded_rng(seed, epoch, 1).permutation(len(sample_map))]


def _truncate(a: np.ndarray, b: np.ndarray, max_tokens: int,
              rng: np.random.RandomState) -> tuple[np.ndarray, np.ndarray]:
    """Drop tokens from the longer segment, at its front or back at random, until both fit."""
    bounds = [[0, len(a)], [0, len(b)]]
    excess = len(a) + len(b) - max_tokens
    for coin in rng.random_sample(max(excess, 0)):
        longer = bounds[0] if bounds[0][1] - bounds[0][0] > bounds[1][1] - bounds[1][0] else bounds[1]
        if coin < 0.5:
            longer[0] += 1
        else:
            longer[1] -= 1
    return a[bounds[0][0]:bounds[0][1]], b[bounds[1][0]:bounds[1][1]]


def make_bert_sample(sentences: list[np.ndarray], target_length: int, settings: BertSampleSettings,
                     rng: np.random.RandomState) -> dict[str, np.ndarray]:
    """One training sample from consecutive sentences (see the module docstring)."""
    special = settings.special
    if settings.binary_head:
        split = int(rng.randint(1, len(sentences)))
        a, b = np.concatenate(sentences[:split]), np.concatenate(sentences[split:])
        is_random = bool(rng.random_sample() < 0.5)
        if is_random:
            a, b = b, a
    else:
        a, b, is_random = np.concatenate(sentences), np.zeros(0, np.int64), False
    a, b = _truncate(a.astype(np.int64), b.astype(np.int64), target_length, rng)

    pieces = [[special.cls], a, [special.sep]] + ([b, [special.sep]] if settings.binary_head else [])
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
    types = np.zeros(len(tokens), dtype=np.int64)
    types[len(a) + 2:] = 1

    candidates = np.flatnonzero((tokens != special.cls) & (tokens != special.sep))
    # stochastic rounding keeps the expected masked fraction exactly mask_prob at every length
    expected = len(candidates) * settings.mask_prob
    count = int(expected) + int(rng.random_sample() < expected - int(expected))
    count = min(max(count, 1), len(candidates))
    positions = np.sort(rng.choice(candidates, size=count, replace=False))
    labels = np.full(settings.seq_length, -1, dtype=np.int64)
    labels[positions] = tokens[positions]
    action = rng.random_sample(count)
    masked = positions[action < MASK_FRACTION]
    randomized = positions[(action >= MASK_FRACTION) & (action < MASK_FRACTION + RANDOM_FRACTION)]
    tokens[masked] = special.mask
    tokens[randomized] = rng.randint(0, settings.vocab_size, size=len(randomized))

    length, pad = len(tokens), settings.seq_length - len(tokens)
    loss_mask = np.zeros(settings.seq_length, dtype=np.float32)
    loss_mask[positions] = 1.0
    return {"text": np.concatenate([tokens, np.full(pad, special.pad, dtype=np.int64)]),
            "types": np.concatenate([types, np.zeros(pad, dtype=np.int64)]),
            "labels": labels,
            "loss_mask": loss_mask,
            "padding_mask": (np.arange(settings.seq_length) < length).astype(np.int64),
            "is_random": np.int64(is_random)}


class BERTDataset:
    """`dataset[i]` -> dict of text/types/labels/loss_mask/padding_mask [seq_length], is_random.

    `document_ids` restricts the dataset to some documents of `indexed` (a split); all by default.
    """

    def __init__(self, indexed: IndexedDataset, num_samples: int, settings: BertSampleSettings,
                 seed: int, name: str = "train", cache_dir: str | None = None,
                 document_ids: np.ndarray | None = None):
        if settings.max_tokens < 2:
            raise ValueError(f"--seq-length {settings.seq_length} leaves no room for two segments")
        if num_samples <= 0:
            raise ValueError(f"BERTDataset {name}: num_samples must be positive, got {num_samples}")
        if document_ids is None:
            document_ids = np.arange(indexed.num_documents, dtype=np.int64)
        document_ids = np.asarray(document_ids, dtype=np.int64)
        self.indexed, self.settings, self.seed, self.name = indexed, settings, seed, name
        description = {"class": "BERTDataset", "version": INDEX_VERSION,
                       "prefix": os.path.abspath(indexed.prefix),
                       "bin_bytes": os.path.getsize(bin_path(indexed.prefix)),
                       "sequence_lengths": fingerprint(indexed.sequence_lengths),
                       "document_indices": fingerprint(indexed.document_indices),
                       "document_ids": fingerprint(document_ids), "num_samples": num_samples,
                       "seq_length": settings.seq_length, "short_seq_prob": settings.short_seq_prob,
                       "binary_head": settings.binary_head, "seed": seed}
        try:
            arrays = build_or_load(
                cache_directory(indexed.prefix, cache_dir), "BERTDataset", name, description,
                lambda: {"sample_map": build_bert_sample_map(
                    indexed.sequence_lengths, indexed.document_indices, document_ids, num_samples,
                    settings, seed)})
        except ValueError as error:
            raise ValueError(f"{indexed.prefix} ({name} split): {error}") from None
        self.sample_map = arrays["sample_map"]

    def __len__(self) -> int:
        return len(self.sample_map)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start, end, target = (int(x) for x in self.sample_map[index])
        sentences = [self.indexed.get(i) for i in range(start, end)]
        return make_bert_sample(sentences, target, self.settings, seeded_rng(self.seed, index, 2))
