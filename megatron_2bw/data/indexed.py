"""Megatron-LM's memory-mapped indexed dataset: a `.bin` of raw token ids and an `.idx` index.

The layout is byte-compatible with Megatron-LM (files written by one load in the other):

    .idx = b"MMIDIDX\\x00\\x00"            9-byte magic
           uint64 version (= 1)
           uint8  dtype code of the .bin tokens (see DTYPE_CODES)
           uint64 sequence count S
           uint64 document-index count (number of documents + 1)
           int32[S]  sequence lengths in tokens
           int64[S]  byte offset of each sequence in the .bin
           int64[D+1] document indices: document k is sequences [doc[k], doc[k+1])
    .bin = the token ids of all sequences, back to back, little-endian

A "sequence" is a whole document for GPT data (`_document` files) and a sentence for BERT data
(`_sentence` files, written with --split-sentences).
"""
from __future__ import annotations

import glob
import os
import struct
import uuid
from array import array

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, two counts

# Megatron-LM's numeric codes for the .bin element type.
DTYPE_CODES: dict[type, int] = {
    np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
    np.float64: 6, np.float32: 7, np.uint16: 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 halves the file when every id fits (vocabulary < 65500)."""
    return np.uint16 if vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def missing_dataset_files(prefix: str) -> str | None:
    """Why `prefix` names no dataset (None if it does), with the likely prefix when only a
    suffix such as tools/preprocess_data.py's `_text_document` was left off."""
    missing = [path for path in (idx_path(prefix), bin_path(prefix)) if not os.path.isfile(path)]
    if not missing:
        return None
    near = sorted(glob.glob(glob.escape(prefix) + "_*.idx"))
    hint = f"; did you mean {near[0][:-len('.idx')]}?" if near else ""
    return (f"{missing[0]} not found (a dataset prefix names PREFIX.bin and PREFIX.idx, as "
            f"tools/preprocess_data.py writes them{hint})")


class IndexedDataset:
    """Read-only view of PREFIX.bin/PREFIX.idx; sequences are numpy views into the memory map."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        missing = missing_dataset_files(prefix)
        if missing:
            raise FileNotFoundError(f"indexed dataset file {missing}")
        self._open()

    def _open(self) -> None:
        path = idx_path(self.prefix)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or header[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{path} is not a Megatron indexed-dataset index: it does not start "
                             f"with the magic bytes {MAGIC!r}")
        version, code, sequence_count, document_count = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise ValueError(f"{path} has index version {version}; only version {VERSION} is supported")
        if code not in CODE_DTYPES:
            raise ValueError(f"{path} has an unknown token dtype code {code} "
                             f"(expected one of {sorted(CODE_DTYPES)})")
        self.dtype = np.dtype(CODE_DTYPES[code])
        expected = HEADER_SIZE + sequence_count * (4 + 8) + document_count * 8
        if size < expected:
            raise ValueError(f"{path} is truncated: {size} bytes, but its header announces "
                             f"{sequence_count} sequences and {document_count} document indices "
                             f"({expected} bytes)")
        index = np.memmap(path, mode="r", dtype=np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(index, np.int32, sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, np.int64, sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, np.int64, document_count, offset)
        if document_count == 0 or self.document_indices[-1] != sequence_count:
            raise ValueError(f"{path} is inconsistent: its document indices must end at the "
                             f"sequence count {sequence_count}")

        data = bin_path(self.prefix)
        expected_bin = (int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize)
        actual_bin = os.path.getsize(data)
        if actual_bin != expected_bin:
            raise ValueError(f"{data} has {actual_bin} bytes but {path} describes {expected_bin} "
                             f"bytes of {self.dtype.name} tokens: the .bin is truncated or does "
                             f"not belong to this .idx")
        # np.memmap refuses empty files; an empty dataset simply has no tokens to map.
        self._tokens = (np.memmap(data, mode="r", dtype=self.dtype) if actual_bin
                        else np.empty(0, self.dtype))

    # A memmap would pickle as a full copy of the data: DataLoader workers reopen the files instead.
    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (all of it by default)."""
        sequence_length = int(self.sequence_lengths[index])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence "
                             f"{index} of length {sequence_length} in {self.prefix}")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def max_token(self, chunk: int = 1 << 26) -> int:
        """Largest token id in the .bin (-1 when empty), read in chunks to bound memory."""
        return max((int(self._tokens[i:i + chunk].max()) for i in range(0, len(self._tokens), chunk)),
                   default=-1)


class IndexedDatasetBuilder:
    """Streams sequences into PREFIX.bin/.idx under temporary names; `finalize` renames them.

    Until `finalize` returns, nothing exists under the final names, so an interrupted run never
    leaves a complete-looking dataset. Lengths are kept in compact arrays (12 bytes per sequence).
    """

    def __init__(self, prefix: str, dtype: type = np.int32):
        if dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported token dtype {dtype}; expected one of {list(DTYPE_CODES)}")
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bin_tmp = bin_path(prefix) + tag
        self._idx_tmp = idx_path(prefix) + tag
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._sequence_lengths = array("i")
        self._document_indices = array("q", [0])

    def add_document(self, tokens: np.ndarray, sequence_lengths: list[int] | np.ndarray) -> None:
        """One document made of consecutive sequences (a single one for GPT data)."""
        self.add_documents(tokens, sequence_lengths, [len(sequence_lengths)])

    def add_documents(self, tokens: np.ndarray, sequence_lengths, sequences_per_document) -> None:
        """Many documents at once: all their tokens, each sequence's length, each document's
        number of sequences (the bulk form keeps the writing process cheap)."""
        tokens = np.asarray(tokens)
        lengths = np.asarray(sequence_lengths, dtype=np.int32)
        counts = np.asarray(sequences_per_document, dtype=np.int64)
        if tokens.size and (tokens.min() < np.iinfo(self.dtype).min
                            or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit the "
                             f"{self.dtype.name} .bin of {self.prefix}")
        if int(lengths.sum(dtype=np.int64)) != tokens.size or int(counts.sum()) != lengths.size:
            raise ValueError(f"inconsistent document for {self.prefix}: {tokens.size} tokens, "
                             f"sequence lengths summing to {int(lengths.sum(dtype=np.int64))}, "
                             f"{lengths.size} sequences but {int(counts.sum())} announced")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        base = len(self._sequence_lengths)
        self._sequence_lengths.frombytes(lengths.tobytes())
        self._document_indices.frombytes((base + np.cumsum(counts)).astype(np.int64).tobytes())

    def add_index(self, prefix: str) -> None:
        """Append a whole existing dataset (used to merge shards)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {prefix} ({other.dtype.name} tokens) into "
                             f"{self.prefix} ({self.dtype.name} tokens)")
        base = len(self._sequence_lengths)
        self._sequence_lengths.frombytes(other.sequence_lengths.tobytes())
        self._document_indices.frombytes((other.document_indices[1:] + base).tobytes())
        with open(bin_path(prefix), "rb") as source:
            while block := source.read(1 << 24):
                self._bin.write(block)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.frombuffer(self._sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, DTYPE_CODES[self.dtype.type], len(lengths),
                                len(self._document_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.frombuffer(self._document_indices, dtype=np.int64).tobytes())
        # The .idx appears last: an .idx under the final name always has its complete .bin.
        if os.path.exists(idx_path(self.prefix)):
            os.remove(idx_path(self.prefix))
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Drop the temporary files (after an error)."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
