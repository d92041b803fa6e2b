"""GLUE tasks: where their data lives, how to read it, BERT input features and official metrics.

Two data sources are understood:
- the GLUE distribution (`download_glue_data.py` layout): one directory per task holding
  `train.tsv`, `dev.tsv`, `test.tsv` (MNLI: `dev_matched.tsv`, `dev_mismatched.tsv`,
  `test_matched.tsv`, `test_mismatched.tsv`), read by `read_task`;
- a local Hugging Face `datasets` copy of the hub's `nyu-mll/glue` config, read by
  `read_task_from_datasets_dir`.
Both yield the same `Example`s, so fine-tuning does not care where the data came from. Test
examples carry their index in the test file, which `submission_tsv` writes into the prediction
files the GLUE server takes. `read_diagnostic` reads GLUE's diagnostic set (AX) from either source:
unlabeled MNLI-style pairs that the server wants predicted by the MNLI model.

Splits are always named the GLUE way ("train", "dev", "dev_matched", "test", ...); the hub's
"validation..." names are derived from them.
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike
from tqdm import tqdm

from megatron_2bw.evaluation.metrics import METRICS


@dataclass(frozen=True)
class GlueTask:
    name: str
    labels: tuple[str, ...]  # label strings of the TSV files, in class-index order; () = regression
    metric_names: tuple[str, ...]  # official metrics, the headline one first
    dev_splits: tuple[str, ...]
    tsv_text_columns: tuple[str, ...]  # header names of text_a (and text_b for pair tasks)
    tsv_label_column: str
    hub_config: str
    hub_text_columns: tuple[str, ...]
    # (hub ClassLabel name, TSV label) in the hub's integer order: the hub encodes labels as ints
    hub_labels: tuple[tuple[str, str], ...] = ()
    # column names of the train/dev files when they have no header row (CoLA); test files have one
    headerless_columns: tuple[str, ...] | None = None
    # Megatron-LM's and transformers' QQP readers skip rows with missing fields: so does QQP here
    skip_malformed_rows: bool = False
    # header name of the test files' example index, which the submission files repeat
    tsv_test_index_column: str = "index"

    @property
    def is_regression(self) -> bool:
        return not self.labels

    @property
    def num_classes(self) -> int:
        """Width of the classification head: 1 output for regression."""
        return 1 if self.is_regression else len(self.labels)

    @property
    def test_splits(self) -> tuple[str, ...]:
        return tuple(split.replace("dev", "test") for split in self.dev_splits)

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", *self.dev_splits, *self.test_splits)

    def check_split(self, split: str) -> None:
        if split not in self.splits:
            raise ValueError(f"{self.name} has no split {split!r}; expected one of {self.splits}")

    def submission_file(self, test_split: str) -> str:
        """The GLUE server's name for the predictions of a test split: CoLA.tsv, MNLI-m.tsv, ..."""
        if test_split not in self.test_splits:
            raise ValueError(f"{self.name} has no test split {test_split!r}; expected one of "
                             f"{self.test_splits}")
        suffix = {"test_matched": "-m", "test_mismatched": "-mm"}.get(test_split, "")
        return f"{self.name}{suffix}.tsv"


_BINARY = ("0", "1")
_ENTAILMENT = ("entailment", "not_entailment")

TASKS: dict[str, GlueTask] = {task.name: task for task in [
    GlueTask("MNLI", ("contradiction", "entailment", "neutral"), ("accuracy",),
             ("dev_matched", "dev_mismatched"), ("sentence1", "sentence2"), "gold_label",
             "mnli", ("premise", "hypothesis"),
             (("entailment", "entailment"), ("neutral", "neutral"),
              ("contradiction", "contradiction"))),
    GlueTask("QQP", _BINARY, ("f1", "accuracy"), ("dev",), ("question1", "question2"),
             "is_duplicate", "qqp", ("question1", "question2"),
             (("not_duplicate", "0"), ("duplicate", "1")), skip_malformed_rows=True,
             tsv_test_index_column="id"),
    GlueTask("QNLI", _ENTAILMENT, ("accuracy",), ("dev",), ("question", "sentence"), "label",
             "qnli", ("question", "sentence"), tuple(zip(_ENTAILMENT, _ENTAILMENT))),
    GlueTask("SST-2", _BINARY, ("accuracy",), ("dev",), ("sentence",), "label",
             "sst2", ("sentence",), (("negative", "0"), ("positive", "1"))),
    GlueTask("CoLA", _BINARY, ("mcc",), ("dev",), ("sentence",), "label",
             "cola", ("sentence",), (("unacceptable", "0"), ("acceptable", "1")),
             headerless_columns=("source", "label", "author_mark", "sentence")),
    GlueTask("STS-B", (), ("pearson", "spearman"), ("dev",), ("sentence1", "sentence2"), "score",
             "stsb", ("sentence1", "sentence2")),
    GlueTask("MRPC", _BINARY, ("f1", "accuracy"), ("dev",), ("#1 String", "#2 String"), "Quality",
             "mrpc", ("sentence1", "sentence2"), (("not_equivalent", "0"), ("equivalent", "1"))),
    GlueTask("RTE", _ENTAILMENT, ("accuracy",), ("dev",), ("sentence1", "sentence2"), "label",
             "rte", ("sentence1", "sentence2"), tuple(zip(_ENTAILMENT, _ENTAILMENT))),
    GlueTask("WNLI", _BINARY, ("accuracy",), ("dev",), ("sentence1", "sentence2"), "label",
             "wnli", ("sentence1", "sentence2"), (("not_entailment", "0"), ("entailment", "1"))),
]}

# GLUE's diagnostic set: MNLI-style pairs, predicted with the MNLI model into AX.tsv. It is read
# as unlabeled MNLI test data under its own name, so errors say "AX" and labels are MNLI's.
DIAGNOSTIC_TASK = "MNLI"
DIAGNOSTIC_SUBMISSION_FILE = "AX.tsv"
_DIAGNOSTIC = replace(TASKS[DIAGNOSTIC_TASK], name="AX", hub_config="ax")


def _canonical(name: str) -> str:
    return name.upper().replace("-", "").replace("_", "")


def get_task(name: str) -> GlueTask:
    """Look a task up by its GLUE name, case and dashes ignored ("sst2", "STS-B", "cola")."""
    for task in TASKS.values():
        if _canonical(name) in (_canonical(task.name), _canonical(task.hub_config)):
            return task
    raise ValueError(f"unknown GLUE task {name!r}; expected one of {', '.join(TASKS)}")


@dataclass(frozen=True)
class Example:
    text_a: str
    text_b: str | None  # None for single-sentence tasks (SST-2, CoLA)
    label: int | float | None  # class index, regression score, or None for unlabeled test rows
    index: int | None = None  # test examples only: their index in the test file (submission_tsv)


def _parse_index(value, where: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: test example index {value!r} is not an integer") from None


# ---------------------------------------------------------------------------- GLUE .tsv files


def _tsv_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(1-based line number, fields) of the non-empty lines.

    GLUE files are not CSV-quoted (sentences contain bare quotes), so fields are split on tabs
    only; lines are split on '\\n' only, so a stray '\\r' inside a sentence cannot break a row.
    """
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not UTF-8 text ({error})") from None
            if line_number == 1:
                line = line.removeprefix("\ufeff")  # MRPC's files start with a byte-order mark
            if line:
                yield line_number, line.split("\t")


def _parse_label(task: GlueTask, value: str, where: str) -> int | float:
    if task.is_regression:
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{where}: {task.name} score {value!r} is not a number") from None
    if value not in task.labels:
        raise ValueError(f"{where}: unknown {task.name} label {value!r}; "
                         f"expected one of {list(task.labels)}")
    return task.labels.index(value)


def read_task(task: str, data_dir: str | Path, split: str) -> list[Example]:
    """Read `{data_dir}/{split}.tsv` of the GLUE distribution.

    Test files have no label column: their examples carry label None, and their index column
    (`tsv_test_index_column`) as `index`. Raises FileNotFoundError for a missing file and ValueError
    naming the file (and line) for a missing column, a short row, an unknown label or a
    non-integer test index.
    """
    spec = get_task(task)
    spec.check_split(split)
    path = Path(data_dir) / f"{split}.tsv"
    if not path.is_file():
        expected = ", ".join(f"{s}.tsv" for s in spec.splits)
        raise FileNotFoundError(f"{path}: no such file; the {spec.name} directory of the GLUE "
                                f"distribution holds {expected}")
    return _read_tsv(spec, path, is_test=split in spec.test_splits)


def _read_tsv(spec: GlueTask, path: Path, is_test: bool) -> list[Example]:
    """The examples of one GLUE file of `spec`'s layout; see `read_task`."""
    rows = _tsv_rows(path)
    if spec.headerless_columns is not None and not is_test:
        header = list(spec.headerless_columns)
    else:
        header = next(rows, (0, []))[1]

    def position(column: str) -> int:
        if column not in header:
            raise ValueError(f"{path}: no column {column!r}; the header has {header}")
        return header.index(column)

    text_positions = [position(column) for column in spec.tsv_text_columns]
    # An unlabeled test file is normal; any other split must be labeled.
    label_position = (None if is_test and spec.tsv_label_column not in header
                      else position(spec.tsv_label_column))
    index_position = position(spec.tsv_test_index_column) if is_test else None
    needed_fields = 1 + max(text_positions + [label_position or 0, index_position or 0])

    examples, skipped_lines = [], []
    for line_number, fields in rows:
        if len(fields) < needed_fields:
            if spec.skip_malformed_rows:
                skipped_lines.append(line_number)
                continue
            raise ValueError(f"{path}:{line_number}: expected at least {needed_fields} "
                             f"tab-separated fields, found {len(fields)}")
        texts = [fields[i].strip() for i in text_positions]
        where = f"{path}:{line_number}"
        label = (None if label_position is None
                 else _parse_label(spec, fields[label_position].strip(), where))
        index = None if index_position is None else _parse_index(fields[index_position], where)
        examples.append(Example(texts[0], texts[1] if len(texts) > 1 else None, label, index))
    if skipped_lines:
        warnings.warn(f"{path}: skipped {len(skipped_lines)} malformed rows "
                      f"(lines {skipped_lines[:5]}{' ...' if len(skipped_lines) > 5 else ''})")
    return examples


# ----------------------------------------------------------------- Hugging Face `datasets` copies

_DATA_FILE_SUFFIXES = (".parquet", ".json", ".jsonl")
HUB_INDEX_COLUMN = "idx"  # the hub's example index, which the submission files repeat for test rows


def _hub_split(split: str) -> str:
    return split.replace("dev", "validation")


def _read_data_files(files: list[Path]):
    """One `datasets.Dataset` from parquet or JSON-lines files (features kept from parquet)."""
    import datasets
    import pyarrow as pa
    import pyarrow.json
    import pyarrow.parquet

    tables = []
    for file in files:
        try:
            if file.suffix == ".parquet":
                tables.append(pyarrow.parquet.read_table(file))
            else:
                tables.append(pyarrow.json.read_json(file))
        except pa.ArrowInvalid as error:
            kind = "parquet" if file.suffix == ".parquet" else "JSON lines (one object a line)"
            raise ValueError(f"{file}: cannot be read as {kind}: {error}") from None
    return datasets.Dataset(pa.concat_tables(tables, promote_options="default"))


def _load_datasets_split(path: Path, split: str):
    """Find `split` in a datasets directory; see `read_task_from_datasets_dir` for the layouts."""
    import datasets

    names = list(dict.fromkeys([_hub_split(split), split]))  # hub name first, GLUE name accepted
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory")
    if (path / "dataset_dict.json").is_file():
        dataset_dict = datasets.load_from_disk(str(path))
        for name in names:
            if name in dataset_dict:
                return dataset_dict[name], path / name
        raise ValueError(f"{path}: no split {' or '.join(names)}; it holds {list(dataset_dict)}")
    if (path / "state.json").is_file():
        raise ValueError(f"{path} holds a single saved Dataset without a split name; save each "
                         f"split as {path}/<split>/ (e.g. {path}/{names[0]}) or save a DatasetDict")
    for name in names:
        split_dir = path / name
        if (split_dir / "state.json").is_file():
            return datasets.load_from_disk(str(split_dir)), split_dir
        if split_dir.is_dir():  # the hub's parquet-converter layout: <split>/0000.parquet
            files = sorted(f for f in split_dir.iterdir() if f.suffix in _DATA_FILE_SUFFIXES)
        else:  # the hub's layout: <split>-00000-of-00001.parquet, or plain <split>.jsonl
            files = sorted(f for f in path.iterdir() if f.suffix in _DATA_FILE_SUFFIXES
                           and (f.stem == name or f.name.startswith(f"{name}-")))
        if files:
            return _read_data_files(files), files[0] if len(files) == 1 else path
    raise FileNotFoundError(
        f"{path}: no split {' or '.join(names)}: expected a datasets.save_to_disk directory, a "
        f"{names[0]}/ directory, or {names[0]}-*.parquet / {names[0]}.jsonl files")


def _label_index_of_hub_int(spec: GlueTask, dataset, where: Path) -> list[int]:
    """Map the dataset's integer labels to our class indices, by name when the data names them."""
    import datasets

    hub_names = [hub_name for hub_name, _ in spec.hub_labels]
    feature = dataset.features["label"]
    names = feature.names if isinstance(feature, datasets.ClassLabel) else hub_names
    unknown = [name for name in names if name not in hub_names]
    if unknown:
        raise ValueError(f"{where}: label names {names} do not match {spec.name}'s {hub_names}")
    tsv_label_of = dict(spec.hub_labels)
    return [spec.labels.index(tsv_label_of[name]) for name in names]


def read_task_from_datasets_dir(task: str, path: str | Path, split: str) -> list[Example]:
    """Read a split of a local Hugging Face copy of the task (the hub's `nyu-mll/glue` config).

    `path` is one of:
    - a `DatasetDict.save_to_disk` directory (`dataset_dict.json`, one folder per split);
    - a directory with one `Dataset.save_to_disk` folder per split (`validation/state.json`);
    - a directory of per-split data files as on the hub: `validation-00000-of-00001.parquet`,
      `validation/0000.parquet`, or `validation.jsonl` (JSON lines).
    Split names are GLUE's ("dev", "dev_matched", ...), looked up as the hub's ("validation",
    "validation_matched", ...) or verbatim. Columns are the hub's (e.g. MNLI premise/hypothesis)
    with an integer `label` (class index in the hub's order, or -1 for unlabeled test rows; a
    float score for STS-B). Test splits also need the hub's `idx` column, the examples' `index`.
    """
    spec = get_task(task)
    spec.check_split(split)
    dataset, where = _load_datasets_split(Path(path), split)
    return _dataset_examples(spec, dataset, where, split, is_test=split in spec.test_splits)


def _dataset_examples(spec: GlueTask, dataset, where: Path, split: str,
                      is_test: bool) -> list[Example]:
    """The examples of one split of a `datasets` copy; see `read_task_from_datasets_dir`."""
    columns = [*spec.hub_text_columns, "label", *([HUB_INDEX_COLUMN] if is_test else [])]
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise ValueError(f"{where}: no column {missing[0]!r} for {spec.name}; "
                         f"it has {dataset.column_names}")
    label_index = None if spec.is_regression else _label_index_of_hub_int(spec, dataset, where)
    data = dataset.select_columns(columns).to_dict()
    examples = []
    text_count = len(spec.hub_text_columns)
    for row, values in enumerate(zip(*(data[column] for column in columns))):
        texts, label = values[:text_count], values[text_count]
        index = _parse_index(values[text_count + 1], f"{where}: row {row}") if is_test else None
        if label is None or label == -1:
            if not is_test:
                raise ValueError(f"{where}: row {row} of split {split!r} has no label (-1); "
                                 f"only test splits may be unlabeled")
            label = None
        elif spec.is_regression:
            if not isinstance(label, (int, float)):
                raise ValueError(f"{where}: row {row}: {spec.name} score {label!r} is not a number")
            label = float(label)
        elif not isinstance(label, int) or not 0 <= label < len(label_index):
            raise ValueError(f"{where}: row {row}: unknown {spec.name} label {label!r}; "
                             f"expected an integer in 0..{len(label_index) - 1}, or -1")
        else:
            label = label_index[label]
        examples.append(Example(texts[0], texts[1] if len(texts) > 1 else None, label, index))
    return examples


# ------------------------------------------------------------------------ the diagnostic set


def read_diagnostic(path: str | Path) -> list[Example]:
    """GLUE's diagnostic set (AX), unlabeled, each example with its `index`.

    `path` is the GLUE distribution's `diagnostic/diagnostic.tsv` (header `index sentence1
    sentence2`), or a directory holding a local Hugging Face `datasets` copy of the hub's `ax`
    config in any layout `read_task_from_datasets_dir` reads: a `test` split with the columns
    premise, hypothesis, label (-1) and idx. Errors are `read_task`'s and
    `read_task_from_datasets_dir`'s, naming the file.
    """
    path = Path(path)
    if path.is_dir():
        dataset, where = _load_datasets_split(path, "test")
        return _dataset_examples(_DIAGNOSTIC, dataset, where, "test", is_test=True)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or directory; expected GLUE's "
                                f"diagnostic/diagnostic.tsv or a datasets copy of the hub's ax "
                                f"config")
    return _read_tsv(_DIAGNOSTIC, path, is_test=True)


# ---------------------------------------------------------------------------------- features


class PairTokenizer(Protocol):
    """What feature building needs from megatron_2bw.data.tokenizers."""
    cls: int
    sep: int
    pad: int

    def tokenize(self, text: str) -> list[int]: ...


def _truncate_longest_first(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Drop tokens from the end of the longer text (b on ties) until both fit in `budget`."""
    a_length, b_length = len(a), len(b)
    while a_length + b_length > budget:
        if a_length > b_length:
            a_length -= 1
        else:
            b_length -= 1
    return a[:a_length], b[:b_length]


def build_features(examples: Sequence[Example], tokenizer: PairTokenizer,
                   seq_length: int) -> dict[str, np.ndarray]:
    """BERT inputs "[CLS] a [SEP] b [SEP]" (or "[CLS] a [SEP]"), padded to `seq_length`.

    Returns int64 arrays `text`, `types` (0 up to and including the first [SEP], 1 for b and its
    [SEP]), `padding_mask` (1 = real token), all [N, seq_length], and `label` [N]: float32 when
    any label is a float (STS-B), else int64. Unlabeled examples get -1 (NaN for float32).
    """
    if seq_length < 3:
        raise ValueError(f"seq_length must be at least 3 ([CLS] a [SEP] b [SEP]), got {seq_length}")
    count = len(examples)
    text = np.full((count, seq_length), tokenizer.pad, dtype=np.int64)
    types = np.zeros((count, seq_length), dtype=np.int64)
    padding_mask = np.zeros((count, seq_length), dtype=np.int64)
    regression = any(isinstance(example.label, float) for example in examples)
    labels = np.full(count, np.nan if regression else -1, dtype=np.float32 if regression else np.int64)

    for row, example in enumerate(tqdm(examples, desc="tokenizing", unit="example", disable=None)):
        is_pair = example.text_b is not None
        a, b = _truncate_longest_first(tokenizer.tokenize(example.text_a),
                                       tokenizer.tokenize(example.text_b) if is_pair else [],
                                       seq_length - (3 if is_pair else 2))
        tokens = [tokenizer.cls, *a, tokenizer.sep]
        segment_a_length = len(tokens)
        if is_pair:
            tokens += [*b, tokenizer.sep]
        text[row, :len(tokens)] = tokens
        types[row, segment_a_length:len(tokens)] = 1
        padding_mask[row, :len(tokens)] = 1
        if example.label is not None:
            labels[row] = example.label
    return {"text": text, "types": types, "padding_mask": padding_mask, "label": labels}


# ----------------------------------------------------------------------------------- metrics


def task_metrics(task: str, predictions: ArrayLike, labels: ArrayLike) -> dict[str, float]:
    """The task's official metrics. Predictions are class indices, or scores for STS-B."""
    spec = get_task(task)
    return {name: METRICS[name](predictions, labels) for name in spec.metric_names}


def submission_tsv(task: str, indices: Sequence[int], predictions: ArrayLike) -> str:
    """A test split's predictions in the GLUE server's format: the header "index<tab>prediction",
    then one row per example, in file order, with the example's own index and its predicted label
    string (`GlueTask.labels`, e.g. "entailment", "0"), or for STS-B the score clipped to the
    server's range [0, 5] with three decimals."""
    spec = get_task(task)
    predictions = np.asarray(predictions)
    if len(indices) != len(predictions):
        raise ValueError(f"{spec.name}: {len(predictions)} predictions for {len(indices)} test "
                         f"examples")
    if spec.is_regression:
        cells = [f"{score:.3f}" for score in np.clip(predictions, 0.0, 5.0)]
    else:
        cells = [spec.labels[class_index] for class_index in predictions]
    rows = [f"{index}\t{cell}" for index, cell in zip(indices, cells)]
    return "\n".join(["index\tprediction", *rows]) + "\n"


def format_results_table(result_files: Sequence[str | Path]) -> str:
    """A text table of the last epoch of each `tools/finetune_glue.py --results` JSON file.

    Each file holds {"task": T, "metric_names": [...], "epochs": [{"epoch": 1, "split": "dev",
    "metrics": {name: value}}, ...]}, one entry per (epoch, evaluated split): MNLI has one with
    "dev_matched" and one with "dev_mismatched" per epoch.
    """
    rows = [("task", "split", "epoch", "metric", "value")]
    for file in map(Path, result_files):
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no such results file")
        try:
            results = json.loads(file.read_text())
            last_epoch = max(entry["epoch"] for entry in results["epochs"])
            for entry in results["epochs"]:
                if entry["epoch"] == last_epoch:
                    for name in results["metric_names"]:
                        rows.append((results["task"], entry["split"], str(last_epoch), name,
                                     f"{entry['metrics'][name]:.4f}"))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{file}: not a finetune_glue results file ({error!r}); expected "
                             f'{{"task", "metric_names", "epochs": [{{"epoch", "split", '
                             f'"metrics"}}]}}') from None
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)
