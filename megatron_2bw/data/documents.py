"""Streaming readers of raw text documents for the preprocessing and tokenizer-training tools.

Supported inputs: .jsonl (one JSON object per line; a .json file starting with "{" is read the
same way, Megatron's "loose json"), .json holding one JSON array of objects, .parquet, .csv,
.txt (one document per non-empty line, under the key "text"), a directory of such files, or a
directory written by `datasets.Dataset.save_to_disk`. Nothing is loaded whole: files are read in
blocks, so memory stays bounded whatever the input size.

Line-based records travel as raw bytes and are parsed by `parse_record`, so the tool can parse
JSON in its worker processes rather than in the single reading process.
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from typing import Iterator

LINE_KINDS = ("jsonl", "txt")  # records are raw lines: cheap to read, splittable by byte ranges
_EXTENSIONS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv",
               ".txt": "txt"}


@dataclass(frozen=True)
class Source:
    """One input file (or a byte range of a line-based file, for --partitions)."""

    path: str
    kind: str  # jsonl | json | parquet | csv | txt | arrow
    start: int = 0
    end: int | None = None  # exclusive byte offset; None = end of file

    @property
    def size(self) -> int | None:
        """Bytes this source covers, when the kind is line-based (None otherwise)."""
        if self.kind not in LINE_KINDS:
            return None
        end = os.path.getsize(self.path) if self.end is None else self.end
        return end - self.start


def _is_saved_dataset(directory: str) -> bool:
    names = set(os.listdir(directory))
    return "dataset_dict.json" in names or {"state.json", "dataset_info.json"} <= names


def _file_kind(path: str) -> str:
    kind = _EXTENSIONS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise ValueError(f"--input {path}: unsupported file type (expected one of "
                         f"{', '.join(sorted(_EXTENSIONS))}, or a directory)")
    if kind == "json":
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
        if not head.startswith(b"["):
            kind = "jsonl"  # Megatron's .json inputs are one object per line
    return kind


def find_sources(inputs: list[str]) -> list[Source]:
    """Expand --input paths (files, directories of files, saved `datasets` directories)."""
    sources = []
    for path in inputs:
        if os.path.isdir(path):
            if _is_saved_dataset(path):
                sources.append(Source(path, "arrow"))
                continue
            files = sorted(os.path.join(path, name) for name in os.listdir(path)
                           if os.path.splitext(name)[1].lower() in _EXTENSIONS)
            if not files:
                raise ValueError(f"--input {path}: the directory holds no "
                                 f"{'/'.join(sorted(_EXTENSIONS))} files")
            sources.extend(Source(f, _file_kind(f)) for f in files)
        elif os.path.isfile(path):
            sources.append(Source(path, _file_kind(path)))
        else:
            raise FileNotFoundError(f"--input {path}: no such file or directory")
    return sources


def partition_sources(sources: list[Source], partitions: int) -> list[list[Source]]:
    """Split the input into at most `partitions` contiguous groups of about equal size.

    Several files are grouped whole; a single line-based file is cut into byte ranges (each
    reader then starts at the first line beginning inside its range).
    """
    if partitions <= 1:
        return [sources]
    if len(sources) == 1 and sources[0].kind in LINE_KINDS:
        source = sources[0]
        size = source.size
        bounds = [size * i // partitions for i in range(partitions + 1)]
        return [[Source(source.path, source.kind, a, b)] for a, b in zip(bounds, bounds[1:]) if b > a]
    count = min(partitions, len(sources))
    return [sources[len(sources) * i // count: len(sources) * (i + 1) // count] for i in range(count)]


def iter_raw_records(source: Source, keys: list[str]) -> Iterator[tuple[bytes | dict, int]]:
    """(record, input bytes) pairs: raw lines for line kinds, dicts of texts for the others."""
    if source.kind in LINE_KINDS:
        yield from _iter_lines(source)
    elif source.kind == "json":
        yield from _iter_json_array(source.path)
    elif source.kind == "csv":
        with open(source.path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                yield row, _text_bytes(row, keys)
    elif source.kind == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(source.path)
        _check_columns(source.path, parquet.schema_arrow.names, keys)
        for batch in parquet.iter_batches(batch_size=1024, columns=keys):
            for row in batch.to_pylist():
                yield row, _text_bytes(row, keys)
    elif source.kind == "arrow":
        yield from _iter_saved_dataset(source.path, keys)
    else:
        raise ValueError(f"unknown source kind {source.kind}")


def _iter_lines(source: Source) -> Iterator[tuple[bytes, int]]:
    with open(source.path, "rb") as f:
        if source.start > 0:
            f.seek(source.start - 1)
            f.readline()  # finish the line that began before this range
        position = f.tell()
        end = float("inf") if source.end is None else source.end
        while position < end:
            line = f.readline()
            if not line:
                break
            position += len(line)
            yield line, len(line)


def _iter_json_array(path: str, block: int = 1 << 20) -> Iterator[tuple[dict, int]]:
    """Objects of a top-level JSON array, decoded one at a time from a sliding buffer."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buffer, position, eof = "", 0, False
        opened, discarded = False, 0  # discarded: characters dropped from the buffer's front
        while True:
            # skip separators; refill when the buffer runs dry
            while position < len(buffer) and buffer[position] in " \t\r\n,":
                position += 1
            if not opened and position < len(buffer):
                if buffer[position] != "[":
                    raise ValueError(f"{path}: expected a JSON array of objects")
                opened, position = True, position + 1
                continue
            if position < len(buffer) and buffer[position] == "]":
                return
            try:
                if position >= len(buffer):
                    raise json.JSONDecodeError("need more", buffer, position)
                value, end = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError as error:
                if eof:
                    raise ValueError(f"{path}: invalid JSON at character {discarded + error.pos}"
                                     f" ({error.msg})") from None
                more = f.read(block)
                eof = not more
                discarded += position
                buffer, position = buffer[position:] + more, 0
                continue
            if not isinstance(value, dict):
                raise ValueError(f"{path}: array elements must be JSON objects, got "
                                 f"{type(value).__name__}")
            yield value, end - position
            position = end


def _iter_saved_dataset(path: str, keys: list[str]) -> Iterator[tuple[dict, int]]:
    import datasets

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"--input {path}: a saved DatasetDict must have a 'train' split "
                             f"(found {', '.join(loaded)})")
        loaded = loaded["train"]
    _check_columns(path, loaded.column_names, keys)
    for batch in loaded.select_columns(keys).iter(batch_size=1024):
        for i in range(len(batch[keys[0]])):
            row = {key: batch[key][i] for key in keys}
            yield row, _text_bytes(row, keys)


def _check_columns(path: str, columns: list[str], keys: list[str]) -> None:
    missing = [key for key in keys if key not in columns]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r} for --json-keys (columns: "
                         f"{', '.join(columns)})")


def _text_bytes(row: dict, keys: list[str]) -> int:
    return sum(len(str(row.get(key, "")).encode("utf-8")) for key in keys)


def parse_record(kind: str, record: bytes | dict, keys: list[str], where: str) -> dict[str, str] | None:
    """The texts of one record by key, or None for a blank line. `where` locates it in errors."""
    if kind == "txt":
        text = record.decode("utf-8").strip()
        if keys != ["text"]:
            raise ValueError(f"{where}: a .txt input has only the key 'text', not --json-keys "
                             f"{' '.join(keys)}")
        return {"text": text} if text else None
    if kind == "jsonl":
        if not record.strip():
            return None
        try:
            record = json.loads(record)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{where}: invalid JSON ({error})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    texts = {}
    for key in keys:
        value = record.get(key)
        if not isinstance(value, str):
            problem = "has no key" if value is None else f"has a {type(value).__name__} under key"
            raise ValueError(f"{where}: the record {problem} {key!r} (--json-keys expects text)")
        texts[key] = value
    return texts


def iter_documents(sources: list[Source], keys: list[str]) -> Iterator[dict[str, str]]:
    """Every document's texts by key, in input order (single process)."""
    for source in sources:
        for number, (record, _) in enumerate(iter_raw_records(source, keys), 1):
            texts = parse_record(source.kind, record, keys, describe(source, number))
            if texts is not None:
                yield texts


def describe(source: Source, number: int) -> str:
    """Human location of the number-th record (1-based) of a source, for error messages."""
    if source.kind in LINE_KINDS:
        if source.start == 0:
            return f"{source.path}: line {number}"
        return f"{source.path}: line {number} after byte offset {source.start}"
    return f"{source.path}: record {number}"
