"""Train/valid/test datasets from the data flags (--data-path/--split, --{train,valid,test}-data-path,
--mock-data), GPT or BERT by config.model.model_type.

Index arrays are cached on disk (index_cache.py). Under torch.distributed, call
`build_pretraining_datasets` on rank 0 first, barrier, then on the other ranks: they load what rank 0
built. A split that gets no documents, or is asked for 0 samples, is returned as None.
"""
from __future__ import annotations

import logging
import os
import re
import zlib

import numpy as np

from megatron_2bw.config import Config, ConfigError, DataConfig
from megatron_2bw.data.bert_dataset import BERTDataset, BertSampleSettings, BertSpecialTokens
from megatron_2bw.data.blended import BlendedDataset, normalize_weights, samples_needed
from megatron_2bw.data.gpt_dataset import DocumentBoundaries, GPTDataset
from megatron_2bw.data.index_cache import build_or_load, cache_directory
from megatron_2bw.data.indexed import IndexedDataset, bin_path, missing_dataset_files
from megatron_2bw.data.mock import MockBERTDataset, MockGPTDataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
# the per-split data flags (instead of --data-path with --split): split, DataConfig field, flag
SPLIT_PATH_FLAGS = (("train", "train_data_path", "--train-data-path"),
                    ("valid", "valid_data_path", "--valid-data-path"),
                    ("test", "test_data_path", "--test-data-path"))
# ids a mock BERT uses when the tokenizer has no BERT special tokens
MOCK_BERT_SPECIAL = BertSpecialTokens(pad=0, cls=1, sep=2, mask=3)


def parse_blend(values: list[str], flag: str) -> tuple[list[float], list[str]]:
    """`PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...` -> (normalised weights, prefixes)."""
    if len(values) == 1:
        return [1.0], list(values)
    usage = f"{flag} expects PREFIX or W1 PREFIX1 W2 PREFIX2 ..., got {' '.join(values)!r}"
    if len(values) % 2:
        raise ValueError(usage)
    try:
        weights = [float(w) for w in values[0::2]]
    except ValueError:
        raise ValueError(usage) from None
    return normalize_weights(weights, flag), list(values[1::2])


def parse_split(split: str) -> list[float]:
    """--split "969,30,1" (or with "/") -> three fractions summing to 1; missing parts are 0."""
    try:
        parts = [float(p) for p in re.split(r"[,/]", split.strip())]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split expects up to three non-negative weights such as 969,30,1, "
                         f"got {split!r}")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def check_data_flags(data: DataConfig, seq_length: int | None = None, model_type: str = "gpt",
                     splits: tuple[str, ...] = SPLIT_NAMES) -> None:
    """The data flags' syntax and files, checked on every rank before any process group or model
    exists: a mistake ends the job with one line naming the flag (ConfigError). The files must be
    a readable dataset with documents; of the `splits` the run reads, train must get documents and
    a GPT split that gets documents must hold one sample (`seq_length` + 1 tokens)."""
    if data.mock_data:
        return
    if data.data_path is not None:  # --split applies to --data-path only
        try:
            parse_split(data.split)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    for paths, flag, split in ((data.data_path, "--data-path", None),
                               *((getattr(data, field), flag, name)
                                 for name, field, flag in SPLIT_PATH_FLAGS)):
        if paths is None:
            continue
        try:
            prefixes = parse_blend(paths, flag)[1]
        except ValueError as error:
            raise ConfigError(str(error)) from None
        fractions = parse_split(data.split) if split is None else None
        checked = splits if split is None else tuple(n for n in splits if n == split)
        train_documents = 0
        for prefix in prefixes:
            missing = missing_dataset_files(prefix)
            if missing:
                raise ConfigError(f"{flag} {prefix}: {missing}")
            train_documents += _check_dataset_files(flag, prefix, fractions, checked,
                                                    seq_length if model_type == "gpt" else None)
        if split is None and "train" in splits and train_documents == 0:
            raise ConfigError(f"--split {data.split} gives the train split of --data-path no "
                              f"documents")


def _check_dataset_files(flag: str, prefix: str, fractions: list[float] | None,
                         splits: tuple[str, ...], seq_length: int | None) -> int:
    """Checks one dataset, whole or split by `fractions` (--split), for the `splits` read;
    returns the documents of its train split."""
    try:
        indexed = IndexedDataset(prefix)
    except ValueError as error:
        raise ConfigError(f"{flag} {prefix}: {error}") from None
    if indexed.num_documents == 0:
        raise ConfigError(f"{flag} {prefix}: the dataset holds no documents (was "
                          f"tools/preprocess_data.py given an empty input?)")
    ranges = (split_document_ranges(indexed.num_documents, fractions) if fractions is not None
              else [(0, indexed.num_documents)] * 3)
    for name, (first, last) in zip(SPLIT_NAMES, ranges):
        if seq_length is None or name not in splits or last <= first:
            continue
        lengths = indexed.sequence_lengths[indexed.document_indices[first]:
                                           indexed.document_indices[last]]
        # the first seq_length + 1 sequences usually suffice: no pass over a large index
        tokens = int(lengths[:seq_length + 1].sum(dtype=np.int64))
        if tokens < seq_length + 1:
            tokens = int(lengths.sum(dtype=np.int64))
        if tokens < seq_length + 1:
            where = f"the {name} split of " if fractions is not None else ""
            raise ConfigError(f"{flag} {prefix}: {where}the data has {tokens} tokens, fewer than "
                              f"--seq-length + 1 = {seq_length + 1} (one sample): use more data, "
                              f"a shorter --seq-length or another --split")
    return ranges[0][1] - ranges[0][0]


def split_document_ranges(num_documents: int, fractions: list[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) document ranges for train, valid and test."""
    bounds = np.round(np.cumsum([0.0] + fractions) * num_documents).astype(np.int64)
    bounds[-1] = num_documents
    return [(int(a), int(b)) for a, b in zip(bounds, bounds[1:])]


def check_vocabulary(indexed: IndexedDataset, tokenizer, cache_dir: str | None) -> None:
    """A token id beyond the vocabulary would index past the embedding: fail at build time.
    The largest id takes one pass over the .bin, so it is cached like the sample indices."""
    data = bin_path(indexed.prefix)
    description = {"prefix": os.path.abspath(indexed.prefix), "bin_bytes": os.path.getsize(data),
                   "bin_mtime_ns": os.stat(data).st_mtime_ns}
    cached = build_or_load(cache_directory(indexed.prefix, cache_dir), "MaxToken",
                           os.path.basename(indexed.prefix), description,
                           lambda: {"max_token": np.array([indexed.max_token()])})
    largest = int(cached["max_token"][0])
    if largest >= tokenizer.vocab_size:
        raise ConfigError(f"{bin_path(indexed.prefix)} contains token id {largest}, but the "
                          f"tokenizer ({tokenizer.name}) has only {tokenizer.vocab_size} ids: the "
                          f"data was preprocessed with another tokenizer or --vocab-size")


class _DatasetFactory:
    """Builds one GPT or BERT dataset from (prefix, split name, document range, sample count)."""

    def __init__(self, config: Config, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.opened: dict[str, IndexedDataset] = {}
        if config.model.model_type == "bert":
            self.bert = BertSampleSettings(
                config.model.seq_length, tokenizer.vocab_size,
                BertSpecialTokens.from_tokenizer(tokenizer), config.data.mask_prob,
                config.data.short_seq_prob, config.model.bert_binary_head)

    def indexed(self, prefix: str) -> IndexedDataset:
        if prefix not in self.opened:
            dataset = IndexedDataset(prefix)
            check_vocabulary(dataset, self.tokenizer, self.config.data.data_cache_path)
            self.opened[prefix] = dataset
        return self.opened[prefix]

    def build(self, prefix: str, name: str, documents: tuple[int, int] | None, num_samples: int):
        indexed = self.indexed(prefix)
        first, last = documents if documents is not None else (0, indexed.num_documents)
        if last <= first:
            return None
        seed, cache = self.config.training.seed, self.config.data.data_cache_path
        if self.config.model.model_type == "bert":
            return BERTDataset(indexed, num_samples, self.bert, seed, name, cache,
                               document_ids=np.arange(first, last))
        sequences = np.arange(indexed.document_indices[first], indexed.document_indices[last])
        return GPTDataset(indexed, num_samples, self.config.model.seq_length, seed, name, cache,
                          sequence_ids=sequences)


def _blend(factory: _DatasetFactory, weights: list[float], prefixes: list[str], name: str,
           num_samples: int, fractions: list[float] | None):
    """One split: a single dataset, or a blend of the prefixes' datasets for this split."""
    split = SPLIT_NAMES.index(name)
    parts = []
    for weight, prefix in zip(weights, prefixes):
        documents = None
        if fractions is not None:
            documents = split_document_ranges(factory.indexed(prefix).num_documents, fractions)[split]
        needed = num_samples if len(prefixes) == 1 else samples_needed(weight, num_samples)
        dataset = factory.build(prefix, name, documents, needed)
        if dataset is None:
            logger.warning("the %s split of %s has no documents", name, prefix)
        else:
            parts.append((weight, dataset))
    if not parts:
        return None
    if len(prefixes) == 1:
        return parts[0][1]
    return BlendedDataset([d for _, d in parts], [w for w, _ in parts], num_samples)


def _build_mock(config: Config, tokenizer, name: str, num_samples: int):
    seed = zlib.crc32(f"{config.training.seed}-{name}".encode())  # distinct data per split
    vocab_size = config.model.vocab_size
    if config.model.model_type == "gpt":
        return MockGPTDataset(num_samples, config.model.seq_length, vocab_size, seed)
    has_bert_tokens = tokenizer is not None and all(
        tokenizer.has(role) for role in ("cls", "sep", "mask", "pad"))
    special = BertSpecialTokens.from_tokenizer(tokenizer) if has_bert_tokens else MOCK_BERT_SPECIAL
    settings = BertSampleSettings(config.model.seq_length, vocab_size, special,
                                  config.data.mask_prob, config.data.short_seq_prob,
                                  config.model.bert_binary_head)
    return MockBERTDataset(num_samples, settings, seed)


def build_pretraining_datasets(config: Config, tokenizer, num_samples: tuple[int, int, int]):
    """(train, valid, test) datasets with at least num_samples[i] samples each (None if empty)."""
    if config.model.model_type not in ("gpt", "bert"):
        raise ValueError(f"model_type must be 'gpt' or 'bert', got {config.model.model_type!r}")
    datasets = _build_splits(config, tokenizer, num_samples)
    data = config.data
    if not data.uses_document_boundaries:  # GPT only (config_checks.validate)
        return datasets
    return tuple(None if d is None else DocumentBoundaries(
        d, tokenizer.eod, data.eod_mask_loss, data.reset_position_ids, data.reset_attention_mask)
        for d in datasets)


def _build_splits(config: Config, tokenizer, num_samples: tuple[int, int, int]):
    data = config.data
    results = []
    if data.mock_data:
        for name, count in zip(SPLIT_NAMES, num_samples):
            results.append(_build_mock(config, tokenizer, name, count) if count > 0 else None)
        return tuple(results)

    factory = _DatasetFactory(config, tokenizer)
    if data.data_path is not None:
        weights, prefixes = parse_blend(data.data_path, "--data-path")
        fractions = parse_split(data.split)
        for name, count in zip(SPLIT_NAMES, num_samples):
            results.append(_blend(factory, weights, prefixes, name, count, fractions)
                           if count > 0 and fractions[SPLIT_NAMES.index(name)] > 0 else None)
        return tuple(results)

    per_split = {name: (getattr(data, field), flag) for name, field, flag in SPLIT_PATH_FLAGS}
    if data.train_data_path is None:
        raise ValueError("give --data-path, --train-data-path or --mock-data")
    for name, count in zip(SPLIT_NAMES, num_samples):
        paths, flag = per_split[name]
        if paths is None or count <= 0:
            results.append(None)
            continue
        weights, prefixes = parse_blend(paths, flag)
        results.append(_blend(factory, weights, prefixes, name, count, fractions=None))
    return tuple(results)
