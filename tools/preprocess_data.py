"""Tokenize raw documents into Megatron indexed datasets, with Megatron-LM's flags.

    python tools/preprocess_data.py --input data/shakespeare/train.jsonl \\
        --output-prefix data/shakespeare/train --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/shakespeare/spm.model --append-eod --workers 2

writes data/shakespeare/train_text_document.{bin,idx} (one dataset per --json-keys key;
`_sentence` instead of `_document` with --split-sentences). The input is streamed: the reading
process ships blocks of raw records to a pool of workers that parse, split and tokenize them, and
at most a few blocks per worker are in flight, so memory stays bounded whatever the input size.
Outputs appear under their final names only when complete.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
from tqdm import tqdm

from megatron_2bw.config import DataConfig
from megatron_2bw.data.cli import ToolParser, exit_on_user_error
from megatron_2bw.data.documents import (Source, describe, find_sources, iter_raw_records,
                                         parse_record, partition_sources)
from megatron_2bw.data.indexed import (IndexedDataset, IndexedDatasetBuilder, bin_path, idx_path,
                                       token_dtype)
from megatron_2bw.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

CHUNK_BYTES = 1 << 20  # raw input per task sent to a worker
CHUNKS_IN_FLIGHT_PER_WORKER = 4
# Workers and partitions start fresh interpreters: forking this process once it runs threads
# (tqdm's monitor, the tokenizer's and the allocator's) can deadlock in the fork itself.
PROCESSES = multiprocessing.get_context("spawn")


def get_args(argv=None):
    parser = ToolParser(prog="preprocess_data.py", description=__doc__.split("\n")[0],
                        allow_abbrev=False)
    g = parser.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True,
                   help=".jsonl/.json/.parquet/.csv/.txt files, directories of them, or a "
                        "datasets.save_to_disk directory")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys (columns) to tokenize, one output dataset per key")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (BERT data)")
    g.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences: a sentence keeps the line breaks that follow it")
    g.add_argument("--lang", default="english",
                   help="the language of --split-sentences' rule (Megatron-LM's nltk language): "
                        "only english")
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", "--vocab",
                   help="vocab.json (GPT2BPETokenizer) or vocab.txt (WordPiece); --vocab is the "
                        "name in older Megatron-LM scripts")
    g.add_argument("--merge-file", help="merges.txt (GPT2BPETokenizer)")
    g.add_argument("--tokenizer-model", help="SentencePiece .model, or a local HF tokenizer directory")
    g.add_argument("--vocab-size", type=int, default=0, help="ids per NullTokenizer (eod is added)")
    g.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    g = parser.add_argument_group("output")
    g.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_{key}_{document|sentence}.bin/.idx")
    g = parser.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--partitions", type=int, default=1,
                   help="process this many slices of the input concurrently (workers are shared "
                        "among them), then merge")
    g = parser.add_argument_group("Megatron-LM flags that name what this tool does anyway")
    g.add_argument("--dataset-impl", choices=["mmap"],
                   help="older scripts' flag; the output is always the memory-mapped format")
    g.add_argument("--log-interval", type=int,
                   help="accepted; progress shows as a tqdm bar, updated as documents finish")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.partitions < 1:
        parser.error(f"--partitions must be >= 1, got {args.partitions}")
    if args.lang != "english":
        parser.error(f"--lang {args.lang}: the sentence rule here splits at . ! ? before a capital "
                     f"letter, which is English's (nltk's punkt models need a download); only "
                     f"english is accepted")
    return args


# ---------------------------------------------------------------------------------------------
# Sentence splitting. nltk's punkt model needs a download, which is not possible offline, so a
# rule does it: a sentence ends at . ! or ? (plus closing quotes/brackets) before whitespace and a
# capital letter or digit. Abbreviations such as "Mr. Smith" are split too.
_SENTENCE_END = re.compile(r"""[.!?]+["')\]]*(?=\s+["'(\[]?[A-Z0-9])""")


_BREAKS_AFTER = re.compile(r"[^\S\n]*(\n[^\S\n]*)+")  # blanks holding at least one line break


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The sentences of `text`, stripped; with `keep_newlines` (Megatron-LM's --keep-newlines) a
    sentence keeps the line breaks after it, so a reader can tell where the lines ended."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end()
        breaks = _BREAKS_AFTER.match(text, end) if keep_newlines else None
        sentences.append(text[start:end].strip() + ("\n" * breaks.group().count("\n")
                                                    if breaks else ""))
        start = breaks.end() if breaks else end
    sentences.append(text[start:].strip())
    return [s for s in sentences if s.strip()]


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncodeSettings:
    """Everything a worker needs to rebuild the tokenizer and encode records (picklable)."""

    keys: tuple[str, ...]
    data: DataConfig
    vocab_size: int
    sentences: bool
    append_eod: bool
    keep_newlines: bool = False


@dataclass
class Chunk:
    source: Source
    first_number: int  # 1-based number of the first record within its source
    records: list = field(default_factory=list)
    nbytes: int = 0


@dataclass
class EncodedChunk:
    """Per key: all tokens, each sequence's length, each document's sequence count."""

    tokens: dict[str, np.ndarray]
    sequence_lengths: dict[str, np.ndarray]
    sequences_per_document: dict[str, np.ndarray]
    documents: int
    nbytes: int


class Encoder:
    def __init__(self, settings: EncodeSettings):
        self.settings = settings
        self.tokenizer = build_tokenizer(settings.data, settings.vocab_size)
        self.eod = self.tokenizer.eod if settings.append_eod else None

    def encode_text(self, text: str) -> list[list[int]]:
        pieces = split_sentences(text, self.settings.keep_newlines) if self.settings.sentences \
            else [text]
        sequences = [ids for ids in map(self.tokenizer.tokenize, pieces) if ids]
        if sequences and self.eod is not None:
            sequences[-1].append(self.eod)
        return sequences

    def encode_chunk(self, chunk: Chunk) -> EncodedChunk:
        keys = self.settings.keys
        tokens = {key: [] for key in keys}
        lengths = {key: [] for key in keys}
        counts = {key: [] for key in keys}
        documents = 0
        for i, record in enumerate(chunk.records):
            where = describe(chunk.source, chunk.first_number + i)
            texts = parse_record(chunk.source.kind, record, list(keys), where)
            if texts is None:
                continue
            documents += 1
            for key in keys:
                sequences = self.encode_text(texts[key])
                if not sequences:
                    continue  # a document without tokens would be an empty index entry
                for ids in sequences:
                    tokens[key].extend(ids)
                    lengths[key].append(len(ids))
                counts[key].append(len(sequences))
        return EncodedChunk({k: np.asarray(v, dtype=np.int64) for k, v in tokens.items()},
                            {k: np.asarray(v, dtype=np.int32) for k, v in lengths.items()},
                            {k: np.asarray(v, dtype=np.int64) for k, v in counts.items()},
                            documents, chunk.nbytes)


_worker_encoder: Encoder | None = None


def _init_worker(settings: EncodeSettings) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _worker_encoder = Encoder(settings)


def _encode_in_worker(chunk: Chunk) -> EncodedChunk:
    return _worker_encoder.encode_chunk(chunk)


def iter_chunks(sources: list[Source], keys: list[str]) -> Iterator[Chunk]:
    for source in sources:
        chunk = Chunk(source, 1)
        for number, (record, nbytes) in enumerate(iter_raw_records(source, keys), 1):
            chunk.records.append(record)
            chunk.nbytes += nbytes
            if chunk.nbytes >= CHUNK_BYTES:
                yield chunk
                chunk = Chunk(source, number + 1)
        if chunk.records:
            yield chunk


class ReadAhead:
    """Backpressure for Pool.imap, which would otherwise read the whole input ahead: at most
    `size` chunks may be read before their results are consumed."""

    def __init__(self, size: int):
        self._slots = threading.Semaphore(size)
        self._closed = False

    def feed(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        for chunk in chunks:
            self._slots.acquire()
            if self._closed:
                return
            yield chunk

    def consumed(self) -> None:
        self._slots.release()

    def close(self) -> None:
        """Let a reader blocked in `feed` finish, so the pool can be torn down after an error."""
        self._closed = True
        self._slots.release()


def output_prefix(prefix: str, key: str, sentences: bool) -> str:
    return f"{prefix}_{key}_{'sentence' if sentences else 'document'}"


@dataclass
class Stats:
    documents: int = 0
    tokens: int = 0
    nbytes: int = 0


def process(sources: list[Source], settings: EncodeSettings, prefix: str, dtype, workers: int,
            partition: int | None = None) -> Stats:
    """Tokenize `sources` into one dataset per key under `prefix`; returns what was written."""
    builders = {key: IndexedDatasetBuilder(output_prefix(prefix, key, settings.sentences), dtype)
                for key in settings.keys}
    sizes = [source.size for source in sources]
    total = sum(sizes) if None not in sizes else None
    stats = Stats()
    start = time.perf_counter()
    try:
        with tqdm(total=total, unit="B", unit_scale=True, position=partition or 0,
                  dynamic_ncols=True, desc="tokenizing" + (
                      f" part {partition}" if partition is not None else "")) as bar:
            chunks = iter_chunks(sources, list(settings.keys))
            pool = read_ahead = None
            if workers > 1:
                read_ahead = ReadAhead(CHUNKS_IN_FLIGHT_PER_WORKER * workers)
                pool = PROCESSES.Pool(workers, initializer=_init_worker, initargs=(settings,))
                results = pool.imap(_encode_in_worker, read_ahead.feed(chunks))
            else:
                results = map(Encoder(settings).encode_chunk, chunks)
            try:
                for encoded in results:
                    if read_ahead is not None:
                        read_ahead.consumed()
                    for key, builder in builders.items():
                        builder.add_documents(encoded.tokens[key], encoded.sequence_lengths[key],
                                              encoded.sequences_per_document[key])
                        stats.tokens += encoded.tokens[key].size
                    stats.documents += encoded.documents
                    stats.nbytes += encoded.nbytes
                    bar.update(encoded.nbytes)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{stats.documents / elapsed:,.0f} docs/s", refresh=False)
            finally:
                if pool is not None:
                    read_ahead.close()
                    pool.terminate()
                    pool.join()
        for builder in builders.values():
            builder.finalize()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    return stats


def _partition_child(connection, sources, settings, prefix, dtype, workers, partition) -> None:
    try:
        connection.send(("ok", process(sources, settings, prefix, dtype, workers, partition)))
    except Exception as error:  # handed to the parent, which reports it once
        connection.send(("error", f"{type(error).__name__}: {error}" if not isinstance(
            error, (ValueError, FileNotFoundError)) else str(error)))


def _remove_dataset(prefix: str) -> None:
    for path in (idx_path(prefix), bin_path(prefix)):
        if os.path.exists(path):
            os.remove(path)


def process_partitions(groups: list[list[Source]], settings: EncodeSettings, prefix: str, dtype,
                       workers: int) -> Stats:
    """Run the groups concurrently into temporary datasets, then concatenate them in order."""
    part_prefixes = [f"{prefix}.partition{i}.tmp" for i in range(len(groups))]
    workers_each = max(1, workers // len(groups))
    children = []
    try:
        for i, group in enumerate(groups):
            receiver, sender = PROCESSES.Pipe(duplex=False)
            child = PROCESSES.Process(target=_partition_child, args=(
                sender, group, settings, part_prefixes[i], dtype, workers_each, i))
            child.start()
            children.append((child, receiver))
        stats = Stats()
        errors = []
        for child, receiver in children:
            status, value = receiver.recv() if receiver.poll(None) else ("error", "no result")
            child.join()
            if status == "error":
                errors.append(value)
            else:
                stats.documents += value.documents
                stats.tokens += value.tokens
                stats.nbytes += value.nbytes
        if errors:
            raise ValueError(errors[0])
        for key in settings.keys:
            with IndexedDatasetBuilder(output_prefix(prefix, key, settings.sentences), dtype) as merged:
                for part in part_prefixes:
                    merged.add_index(output_prefix(part, key, settings.sentences))
                merged.finalize()
        return stats
    finally:
        for child, _ in children:
            if child.is_alive():
                child.terminate()
                child.join()
        for part in part_prefixes:
            for key in settings.keys:
                _remove_dataset(output_prefix(part, key, settings.sentences))


def refuse_empty_outputs(args) -> None:
    """A dataset without documents would only fail later, in training: remove it and say so."""
    prefixes = [output_prefix(args.output_prefix, key, args.split_sentences)
                for key in args.json_keys]
    empty = [key for key, prefix in zip(args.json_keys, prefixes)
             if IndexedDataset(prefix).num_documents == 0]
    if empty:
        for prefix in prefixes:
            _remove_dataset(prefix)
        raise ValueError(f"--input {' '.join(args.input)}: no text under --json-keys {empty[0]} "
                         f"(empty input, or no record with that key); nothing was written")


def main(argv=None) -> Stats:
    args = get_args(argv)
    data = DataConfig(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
    tokenizer = build_tokenizer(data, args.vocab_size)
    if args.append_eod:
        tokenizer.eod  # fail now, naming the tokenizer, if it has no eod token
    settings = EncodeSettings(tuple(args.json_keys), data, args.vocab_size, args.split_sentences,
                              args.append_eod, args.keep_newlines)
    sources = find_sources(args.input)
    dtype = token_dtype(tokenizer.vocab_size)
    groups = partition_sources(sources, args.partitions)
    start = time.perf_counter()
    if len(groups) > 1:
        stats = process_partitions(groups, settings, args.output_prefix, dtype, args.workers)
    else:
        stats = process(sources, settings, args.output_prefix, dtype, args.workers)
    seconds = time.perf_counter() - start
    refuse_empty_outputs(args)
    outputs = ", ".join(output_prefix(args.output_prefix, key, args.split_sentences) + ".{bin,idx}"
                        for key in args.json_keys)
    print(f"{stats.documents:,} documents, {stats.tokens:,} tokens ({np.dtype(dtype).name}) in "
          f"{seconds:.1f} s ({stats.nbytes / 1e6 / max(seconds, 1e-9):.1f} MB/s) -> {outputs}",
          flush=True)
    return stats


if __name__ == "__main__":
    with exit_on_user_error(sys.argv[0]):
        main()
