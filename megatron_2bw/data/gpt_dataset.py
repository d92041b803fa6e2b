"""GPT pretraining samples: fixed windows of seq_length + 1 tokens cut across documents.

Three index arrays, built once and cached (see index_cache.py), define the samples:

- document_index: for each epoch, a shuffled order of the sequences (documents) in this split,
  epochs concatenated;
- sample_index: where each sample starts, as (position in document_index, token offset);
  sample k of an epoch starts at token k * seq_length of that epoch's concatenated stream, so
  consecutive samples share one token (the last input of one is the first of the next);
- shuffle_index: a permutation of the samples within each epoch.

An epoch holds (tokens - 1) // seq_length samples and never crosses into the next epoch, so the
targets (tokens[1:]) of one epoch's samples are every token of the split exactly once, except the
epoch's first token and the remainder that does not fill a last window. The content of sample i
depends only on the data, seq_length and seed, never on how many ranks read it.
"""
from __future__ import annotations

import math
import os

import numpy as np

from megatron_2bw.data.index_cache import build_or_load, cache_directory, fingerprint
from megatron_2bw.data.indexed import IndexedDataset, bin_path

INDEX_VERSION = 1  # bump when the index construction changes, to invalidate old caches


def seeded_rng(*salt: int) -> np.random.RandomState:
    """RandomState (whose streams are frozen across numpy versions) seeded by several integers."""
    return np.random.RandomState(np.random.SeedSequence(list(salt)).generate_state(4))


def build_gpt_indices(sequence_lengths: np.ndarray, sequence_ids: np.ndarray, num_samples: int,
                      seq_length: int, seed: int) -> dict[str, np.ndarray]:
    lengths = sequence_lengths[sequence_ids].astype(np.int64)
    tokens_per_epoch = int(lengths.sum())
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    epochs = math.ceil(num_samples / samples_per_epoch)
    document_index, sample_index, shuffle_index = [], [], []
    for epoch in range(epochs):
        order = seeded_rng(seed, epoch).permutation(len(sequence_ids))
        document_index.append(sequence_ids[order])
        ends = np.cumsum(lengths[order])
        starts = np.arange(samples_per_epoch, dtype=np.int64) * seq_length
        position = np.searchsorted(ends, starts, side="right")
        offset = starts - (ends[position] - lengths[order][position])
        sample_index.append(np.stack([position + epoch * len(sequence_ids), offset], axis=1))
        shuffle_index.append(epoch * samples_per_epoch
                             + seeded_rng(seed, epoch, 1).permutation(samples_per_epoch))
    return {"document_index": np.concatenate(document_index).astype(np.int64),
            "sample_index": np.concatenate(sample_index).astype(np.int64),
            "shuffle_index": np.concatenate(shuffle_index).astype(np.int64)}


class GPTDataset:
    """`dataset[i] -> {"tokens": int64 [seq_length + 1]}`; len >= num_samples (whole epochs).

    `sequence_ids` restricts the dataset to some sequences of `indexed` (a train/valid/test split);
    all of them by default. Index arrays are cached in `cache_dir` (default: `cache` next to the
    data), in files named by a hash of every parameter.
    """

    def __init__(self, indexed: IndexedDataset, num_samples: int, seq_length: int, seed: int,
                 name: str = "train", cache_dir: str | None = None,
                 sequence_ids: np.ndarray | None = None):
        if sequence_ids is None:
            sequence_ids = np.arange(len(indexed), dtype=np.int64)
        sequence_ids = np.asarray(sequence_ids, dtype=np.int64)
        tokens = int(indexed.sequence_lengths[sequence_ids].sum(dtype=np.int64))
        if num_samples <= 0:
            raise ValueError(f"GPTDataset {name}: num_samples must be positive, got {num_samples}")
        if tokens < seq_length + 1:
            raise ValueError(f"the {name} split of {indexed.prefix} has {tokens} tokens, fewer "
                             f"than --seq-length + 1 = {seq_length + 1}: use more data, a "
                             f"shorter --seq-length or another --split")
        self.indexed, self.name, self.seq_length = indexed, name, seq_length
        description = {"class": "GPTDataset", "version": INDEX_VERSION,
                       "prefix": os.path.abspath(indexed.prefix),
                       "bin_bytes": os.path.getsize(bin_path(indexed.prefix)),
                       "sequence_lengths": fingerprint(indexed.sequence_lengths),
                       "sequence_ids": fingerprint(sequence_ids), "num_samples": num_samples,
                       "seq_length": seq_length, "seed": seed}
        arrays = build_or_load(
            cache_directory(indexed.prefix, cache_dir), "GPTDataset", name, description,
            lambda: build_gpt_indices(indexed.sequence_lengths, sequence_ids, num_samples,
                                      seq_length, seed))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        position, offset = (int(x) for x in self.sample_index[self.shuffle_index[index]])
        pieces, needed = [], self.seq_length + 1
        while needed > 0:
            sequence = int(self.document_index[position])
            take = min(int(self.indexed.sequence_lengths[sequence]) - offset, needed)
            pieces.append(self.indexed.get(sequence, offset, take))
            needed -= take
            position, offset = position + 1, 0
        return {"tokens": np.concatenate(pieces).astype(np.int64)}


class DocumentBoundaries:
    """What Megatron-LM's GPT data flags derive from the end-of-document tokens in a sample's
    inputs, added to the sample:
    - `loss_mask` (--eod-mask-loss): 0 where the input is an end-of-document token, so the target
      after it, the next document's first token, which nothing in the window predicts, is left out;
    - `position_ids` (--reset-position-ids): positions that restart at 0 after each such token;
    - `document_ids` (--reset-attention-mask): each input's document within the window, so that
      attention stays inside one (an end-of-document token belongs to the document it ends)."""

    def __init__(self, dataset, eod: int, loss_mask: bool = False, position_ids: bool = False,
                 document_ids: bool = False):
        self.dataset, self.eod = dataset, eod
        self.loss_mask, self.position_ids, self.document_ids = loss_mask, position_ids, document_ids

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sample = dict(self.dataset[index])
        ends = sample["tokens"][:-1] == self.eod
        document = np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int64)
        if self.loss_mask:
            sample["loss_mask"] = (~ends).astype(np.float32)
        if self.position_ids:
            starts = np.concatenate([[0], np.flatnonzero(ends[:-1]) + 1])
            sample["position_ids"] = np.arange(len(ends), dtype=np.int64) - starts[document]
        if self.document_ids:
            sample["document_ids"] = document
        return sample
