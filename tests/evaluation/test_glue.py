import json
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest

from megatron_2bw.evaluation.glue import (
    TASKS, Example, build_features, format_results_table, get_task, read_diagnostic, read_task,
    read_task_from_datasets_dir, submission_tsv, task_metrics)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Headers of the GLUE distribution's files (CoLA's train/dev files have none).
MNLI_PREFIX = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
               "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]
HEADERS = {
    ("MNLI", "train"): MNLI_PREFIX + ["label1", "gold_label"],
    ("MNLI", "dev"): MNLI_PREFIX + ["label1", "label2", "label3", "label4", "label5", "gold_label"],
    ("MNLI", "test"): MNLI_PREFIX,
    ("QQP", "train"): ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
    ("QQP", "test"): ["id", "question1", "question2"],
    ("QNLI", "train"): ["index", "question", "sentence", "label"],
    ("SST-2", "train"): ["sentence", "label"],
    ("SST-2", "test"): ["index", "sentence"],
    ("CoLA", "test"): ["index", "sentence"],
    ("STS-B", "train"): ["index", "genre", "filename", "year", "old_index", "source1", "source2",
                         "sentence1", "sentence2", "score"],
    ("MRPC", "train"): ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    ("RTE", "train"): ["index", "sentence1", "sentence2", "label"],
    ("WNLI", "train"): ["index", "sentence1", "sentence2", "label"],
    ("WNLI", "test"): ["index", "sentence1", "sentence2"],
    ("AX", "test"): ["index", "sentence1", "sentence2"],  # diagnostic/diagnostic.tsv
}


def write_tsv(path: Path, header: list[str] | None, rows: list[list[str]], prefix: str = ""):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ([header] if header else []) + rows
    path.write_text(prefix + "".join("\t".join(map(str, line)) + "\n" for line in lines),
                    encoding="utf-8")


def mnli_row(index, premise, hypothesis, gold, dev=False):
    annotator_labels = [gold] * (5 if dev else 1)
    return [index, 100 + index, f"{index}e", "fiction", "( x )", "( y )", "(ROOT x)", "(ROOT y)",
            premise, hypothesis, *annotator_labels, gold]


# ------------------------------------------------------------------------- reading .tsv files


def test_every_task_reads_its_glue_layout(tmp_path):
    write_tsv(tmp_path / "MNLI/train.tsv", HEADERS["MNLI", "train"], [
        mnli_row(0, "The cat sat.", "A cat sat.", "entailment"),
        mnli_row(1, "It rained \"hard\".", "It was dry.", "contradiction")])
    write_tsv(tmp_path / "MNLI/dev_matched.tsv", HEADERS["MNLI", "dev"],
              [mnli_row(0, "He ran.", "He moved fast.", "neutral", dev=True)])
    write_tsv(tmp_path / "MNLI/dev_mismatched.tsv", HEADERS["MNLI", "dev"],
              [mnli_row(0, "She sang.", "She was silent.", "contradiction", dev=True)])
    write_tsv(tmp_path / "QQP/dev.tsv", HEADERS["QQP", "train"],
              [[7, 1, 2, "How do I cook rice?", "How is rice cooked?", 1]])
    write_tsv(tmp_path / "QNLI/train.tsv", HEADERS["QNLI", "train"],
              [[0, "Where is Rome?", "Rome is in Italy.", "entailment"],
               [1, "Who wrote it?", "The sky is blue.", "not_entailment"]])
    write_tsv(tmp_path / "SST-2/train.tsv", HEADERS["SST-2", "train"],
              [["a moving film ", 1], ["dull and long", 0]])
    write_tsv(tmp_path / "CoLA/train.tsv", None,
              [["gj04", 1, "", "The book was read."], ["gj04", 0, "*", "Book the read was."]])
    write_tsv(tmp_path / "STS-B/dev.tsv", HEADERS["STS-B", "train"],
              [[0, "main-captions", "MSRvid", "2012test", "0001", "none", "none",
                "A plane takes off.", "An airplane is taking off.", "5.000"],
               [1, "main-news", "MSRpar", "2012test", "0002", "none", "none",
                "Stocks fell.", "A dog barked.", "0.250"]])
    # MRPC's files start with a byte-order mark, which must not hide the "Quality" column
    write_tsv(tmp_path / "MRPC/train.tsv", HEADERS["MRPC", "train"],
              [[1, 702876, 702977, "He said yes.", "He agreed."]], prefix="\ufeff")
    write_tsv(tmp_path / "RTE/dev.tsv", HEADERS["RTE", "train"],
              [[0, "Paris is the capital of France.", "Paris is in France.", "entailment"]])
    write_tsv(tmp_path / "WNLI/train.tsv", HEADERS["WNLI", "train"],
              [[0, "I put the cake in the box because it was small.", "The box was small.", 0],
               [1, "The cup fell on the mat and it broke.", "The cup broke.", 1]])

    assert read_task("MNLI", tmp_path / "MNLI", "train") == [
        Example("The cat sat.", "A cat sat.", 1), Example('It rained "hard".', "It was dry.", 0)]
    assert read_task("MNLI", tmp_path / "MNLI", "dev_matched") == [
        Example("He ran.", "He moved fast.", 2)]
    assert read_task("MNLI", tmp_path / "MNLI", "dev_mismatched") == [
        Example("She sang.", "She was silent.", 0)]
    assert read_task("QQP", tmp_path / "QQP", "dev") == [
        Example("How do I cook rice?", "How is rice cooked?", 1)]
    assert read_task("QNLI", tmp_path / "QNLI", "train") == [
        Example("Where is Rome?", "Rome is in Italy.", 0),
        Example("Who wrote it?", "The sky is blue.", 1)]
    assert read_task("SST-2", tmp_path / "SST-2", "train") == [
        Example("a moving film", None, 1), Example("dull and long", None, 0)]
    assert read_task("CoLA", tmp_path / "CoLA", "train") == [
        Example("The book was read.", None, 1), Example("Book the read was.", None, 0)]
    stsb = read_task("STS-B", tmp_path / "STS-B", "dev")
    assert stsb == [Example("A plane takes off.", "An airplane is taking off.", 5.0),
                    Example("Stocks fell.", "A dog barked.", 0.25)]
    assert isinstance(stsb[0].label, float)
    assert read_task("MRPC", tmp_path / "MRPC", "train") == [
        Example("He said yes.", "He agreed.", 1)]
    assert read_task("RTE", tmp_path / "RTE", "dev") == [
        Example("Paris is the capital of France.", "Paris is in France.", 0)]
    assert read_task("WNLI", tmp_path / "WNLI", "train") == [
        Example("I put the cake in the box because it was small.", "The box was small.", 0),
        Example("The cup fell on the mat and it broke.", "The cup broke.", 1)]


def test_test_files_are_unlabeled_and_carry_their_index(tmp_path):
    write_tsv(tmp_path / "test.tsv", HEADERS["CoLA", "test"], [[17, "Birds fly."], [3, "Fly."]])
    assert read_task("CoLA", tmp_path, "test") == [Example("Birds fly.", None, None, 17),
                                                   Example("Fly.", None, None, 3)]
    write_tsv(tmp_path / "test_mismatched.tsv", HEADERS["MNLI", "test"],
              [mnli_row(4, "A.", "B.", "x")[:10]])
    assert read_task("MNLI", tmp_path, "test_mismatched") == [Example("A.", "B.", None, 4)]
    write_tsv(tmp_path / "test.tsv", HEADERS["QQP", "test"], [[5, "Why?", "Why not?"]])
    assert read_task("QQP", tmp_path, "test") == [Example("Why?", "Why not?", None, 5)]
    write_tsv(tmp_path / "test.tsv", HEADERS["WNLI", "test"], [[2, "It fell.", "It broke."]])
    assert read_task("WNLI", tmp_path, "test") == [Example("It fell.", "It broke.", None, 2)]


def test_test_file_without_integer_index_is_refused(tmp_path):
    # e.g. a train-style file given as the test file: without the index no submission can be made
    write_tsv(tmp_path / "test.tsv", HEADERS["SST-2", "train"], [["a film", 1]])
    with pytest.raises(ValueError, match=r"test.tsv: no column 'index'; the header has "
                                         r"\['sentence', 'label'\]"):
        read_task("SST-2", tmp_path, "test")
    write_tsv(tmp_path / "test.tsv", HEADERS["SST-2", "test"], [[0, "a film"], ["x1", "dull"]])
    with pytest.raises(ValueError, match=r"test.tsv:3: test example index 'x1' is not an integer"):
        read_task("SST-2", tmp_path, "test")


def test_task_registry():
    assert list(TASKS) == ["MNLI", "QQP", "QNLI", "SST-2", "CoLA", "STS-B", "MRPC", "RTE", "WNLI"]
    assert get_task("sst2") is TASKS["SST-2"] and get_task("sts-b") is TASKS["STS-B"]
    assert get_task("cola").metric_names == ("mcc",)
    assert get_task("STS-B").metric_names == ("pearson", "spearman")
    assert get_task("STS-B").is_regression and get_task("STS-B").num_classes == 1
    assert get_task("MRPC").metric_names == get_task("QQP").metric_names == ("f1", "accuracy")
    assert get_task("MNLI").labels == ("contradiction", "entailment", "neutral")
    assert get_task("MNLI").splits == (
        "train", "dev_matched", "dev_mismatched", "test_matched", "test_mismatched")
    assert get_task("RTE").labels == get_task("QNLI").labels == ("entailment", "not_entailment")
    assert get_task("wnli").labels == ("0", "1") and get_task("WNLI").metric_names == ("accuracy",)
    # the diagnostic set is no task of its own: it is predicted with the MNLI model
    with pytest.raises(ValueError, match="unknown GLUE task 'AX'; expected one of MNLI.*WNLI"):
        get_task("AX")
    with pytest.raises(ValueError, match="MNLI has no split 'dev'.*dev_matched"):
        read_task("MNLI", "unused", "dev")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"RTE[/\\]dev.tsv: no such file.*train.tsv, dev.tsv"):
        read_task("RTE", tmp_path / "RTE", "dev")


def test_missing_column_is_named(tmp_path):
    write_tsv(tmp_path / "train.tsv", ["index", "sentence1", "sentence2", "gold"],
              [[0, "a", "b", "entailment"]])
    with pytest.raises(ValueError, match=r"train.tsv: no column 'label'"):
        read_task("RTE", tmp_path, "train")


def test_unknown_label_names_value_and_line(tmp_path):
    write_tsv(tmp_path / "dev.tsv", HEADERS["RTE", "train"],
              [[0, "a", "b", "entailment"], [1, "c", "d", "maybe"]])
    with pytest.raises(ValueError, match=r"dev.tsv:3: unknown RTE label 'maybe'"):
        read_task("RTE", tmp_path, "dev")
    write_tsv(tmp_path / "dev.tsv", HEADERS["STS-B", "train"],
              [[0, "g", "f", "y", "o", "s", "s", "a", "b", "high"]])
    with pytest.raises(ValueError, match=r"dev.tsv:2: STS-B score 'high' is not a number"):
        read_task("STS-B", tmp_path, "dev")


def test_short_rows_fail_except_in_qqp(tmp_path):
    write_tsv(tmp_path / "train.tsv", HEADERS["RTE", "train"], [[0, "only one sentence"]])
    with pytest.raises(ValueError, match=r"train.tsv:2: expected at least 4 tab-separated fields"):
        read_task("RTE", tmp_path, "train")
    # QQP rows broken by a stray newline are dropped, as GLUE baselines do, with a warning
    write_tsv(tmp_path / "train.tsv", HEADERS["QQP", "train"],
              [[0, 1, 2, "What is", "broken"], ["question?", "What is it?", 0],
               [1, 3, 4, "Is it?", "Is it so?", 0]])
    with pytest.warns(UserWarning, match=r"skipped 2 malformed rows \(lines \[2, 3\]\)"):
        assert read_task("QQP", tmp_path, "train") == [Example("Is it?", "Is it so?", 0)]


# ----------------------------------------------------------------- Hugging Face datasets copies

MNLI_HUB_FEATURES = datasets.Features({
    "premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
    "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]),
    "idx": datasets.Value("int32")})


def test_datasets_dict_maps_hub_label_order_to_glue_order(tmp_path):
    validation = datasets.Dataset.from_dict(
        {"premise": ["p0", "p1", "p2"], "hypothesis": ["h0", "h1", "h2"], "label": [0, 1, 2],
         "idx": [0, 1, 2]}, features=MNLI_HUB_FEATURES)
    test = datasets.Dataset.from_dict(
        {"premise": ["t"], "hypothesis": ["u"], "label": [-1], "idx": [7]},
        features=MNLI_HUB_FEATURES)
    datasets.DatasetDict(validation_matched=validation, test_matched=test).save_to_disk(tmp_path)
    # hub ints: entailment=0, neutral=1, contradiction=2; ours: contradiction, entailment, neutral
    assert read_task_from_datasets_dir("MNLI", tmp_path, "dev_matched") == [
        Example("p0", "h0", 1), Example("p1", "h1", 2), Example("p2", "h2", 0)]
    assert read_task_from_datasets_dir("MNLI", tmp_path, "test_matched") == [
        Example("t", "u", None, 7)]
    with pytest.raises(ValueError, match=r"no split validation_mismatched or dev_mismatched; "
                                         r"it holds \['validation_matched', 'test_matched'\]"):
        read_task_from_datasets_dir("MNLI", tmp_path, "dev_mismatched")


def test_tsv_and_datasets_copies_agree(tmp_path):
    gold = ["neutral", "entailment", "contradiction"]
    write_tsv(tmp_path / "tsv/dev_matched.tsv", HEADERS["MNLI", "dev"],
              [mnli_row(i, f"p{i}", f"h{i}", label, dev=True) for i, label in enumerate(gold)])
    hub_names = MNLI_HUB_FEATURES["label"].names
    datasets.Dataset.from_dict(
        {"premise": ["p0", "p1", "p2"], "hypothesis": ["h0", "h1", "h2"],
         "label": [hub_names.index(label) for label in gold], "idx": [0, 1, 2]},
        features=MNLI_HUB_FEATURES).save_to_disk(tmp_path / "hub/validation_matched")
    assert (read_task_from_datasets_dir("MNLI", tmp_path / "hub", "dev_matched")
            == read_task("MNLI", tmp_path / "tsv", "dev_matched"))


def test_wnli_tsv_and_datasets_copies_agree(tmp_path):
    # GLUE's files write 1 for entailment; the hub's ClassLabel is [not_entailment, entailment]
    pairs = [("The trophy did not fit in the case: it was too big.", "The trophy was too big."),
             ("The trophy did not fit in the case: it was too big.", "The case was too big.")]
    write_tsv(tmp_path / "dev.tsv", HEADERS["WNLI", "train"],
              [[i, a, b, label] for i, ((a, b), label) in enumerate(zip(pairs, [1, 0]))])
    expected = [Example(*pairs[0], 1), Example(*pairs[1], 0)]
    assert read_task("WNLI", tmp_path, "dev") == expected
    columns = {"sentence1": [a for a, _ in pairs], "sentence2": [b for _, b in pairs],
               "label": [1, 0], "idx": [0, 1]}
    features = datasets.Features({
        "sentence1": datasets.Value("string"), "sentence2": datasets.Value("string"),
        "label": datasets.ClassLabel(names=["not_entailment", "entailment"]),
        "idx": datasets.Value("int32")})
    datasets.DatasetDict(validation=datasets.Dataset.from_dict(columns, features=features)) \
        .save_to_disk(tmp_path / "hub")
    assert read_task_from_datasets_dir("WNLI", tmp_path / "hub", "dev") == expected
    # without a ClassLabel the integers are taken in the hub's order
    (tmp_path / "jsonl").mkdir()
    datasets.Dataset.from_dict(columns).to_json(tmp_path / "jsonl/validation.jsonl")
    assert read_task_from_datasets_dir("WNLI", tmp_path / "jsonl", "dev") == expected


def test_per_split_saved_datasets_and_custom_label_names(tmp_path):
    # a user's own copy whose ClassLabel order differs from the hub's: labels follow the names
    features = datasets.Features({"sentence1": datasets.Value("string"),
                                  "sentence2": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["not_entailment", "entailment"])})
    datasets.Dataset.from_dict({"sentence1": ["a", "b"], "sentence2": ["c", "d"], "label": [0, 1]},
                               features=features).save_to_disk(tmp_path / "train")
    assert read_task_from_datasets_dir("RTE", tmp_path, "train") == [
        Example("a", "c", 1), Example("b", "d", 0)]


def test_hub_parquet_and_jsonl_files(tmp_path):
    # plain integer labels (no ClassLabel) use the hub's order: sst2 negative=0, positive=1
    datasets.Dataset.from_dict({"sentence": ["great", "awful"], "label": [1, 0], "idx": [0, 1]}) \
        .to_parquet(tmp_path / "train-00000-of-00001.parquet")
    datasets.Dataset.from_dict({"sentence": ["fine"], "label": [1], "idx": [0]}) \
        .to_parquet(tmp_path / "train-00001-of-00002.parquet")
    datasets.Dataset.from_dict({"sentence": ["meh"], "label": [-1], "idx": [3]}) \
        .to_json(tmp_path / "test.jsonl")
    (tmp_path / "validation").mkdir()
    datasets.Dataset.from_dict({"sentence": ["ok"], "label": [0], "idx": [0]}) \
        .to_parquet(tmp_path / "validation/0000.parquet")
    assert read_task_from_datasets_dir("SST-2", tmp_path, "train") == [
        Example("great", None, 1), Example("awful", None, 0), Example("fine", None, 1)]
    assert read_task_from_datasets_dir("SST-2", tmp_path, "test") == [
        Example("meh", None, None, 3)]
    assert read_task_from_datasets_dir("SST-2", tmp_path, "dev") == [Example("ok", None, 0)]

    stsb_dir = tmp_path / "stsb"
    stsb_dir.mkdir()
    datasets.Dataset.from_dict({"sentence1": ["x"], "sentence2": ["y"], "label": [3.8]}) \
        .to_parquet(stsb_dir / "validation-00000-of-00001.parquet")
    assert read_task_from_datasets_dir("STS-B", stsb_dir, "dev") == [
        Example("x", "y", pytest.approx(3.8))]


def test_datasets_errors(tmp_path):
    datasets.Dataset.from_dict({"sentence": ["a"], "label": [-1]}).save_to_disk(tmp_path / "one")
    with pytest.raises(ValueError, match="single saved Dataset without a split name"):
        read_task_from_datasets_dir("CoLA", tmp_path / "one", "train")

    datasets.Dataset.from_dict({"sentence": ["a"], "label": [-1]}) \
        .save_to_disk(tmp_path / "cola/train")
    with pytest.raises(ValueError, match=r"row 0 of split 'train' has no label"):
        read_task_from_datasets_dir("CoLA", tmp_path / "cola", "train")

    datasets.Dataset.from_dict({"text": ["a"], "label": [1]}).to_json(tmp_path / "cola/validation.jsonl")
    with pytest.raises(ValueError, match=r"validation.jsonl: no column 'sentence' for CoLA"):
        read_task_from_datasets_dir("CoLA", tmp_path / "cola", "dev")

    datasets.Dataset.from_dict({"sentence": ["a"], "label": [-1]}) \
        .to_json(tmp_path / "cola/test.jsonl")
    with pytest.raises(ValueError, match=r"test.jsonl: no column 'idx' for CoLA"):
        read_task_from_datasets_dir("CoLA", tmp_path / "cola", "test")

    datasets.Dataset.from_dict({"sentence": ["a"], "label": [5], "idx": [0]}) \
        .to_json(tmp_path / "cola/test.jsonl")
    with pytest.raises(ValueError, match=r"row 0: unknown CoLA label 5"):
        read_task_from_datasets_dir("CoLA", tmp_path / "cola", "test")

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no split validation or dev"):
        read_task_from_datasets_dir("RTE", tmp_path / "empty", "dev")
    with pytest.raises(FileNotFoundError, match=r"absent: no such directory"):
        read_task_from_datasets_dir("RTE", tmp_path / "absent", "dev")


# ------------------------------------------------------------------------ the diagnostic set


def test_diagnostic_set_from_tsv_and_datasets_copies(tmp_path):
    pairs = [("The cat sat.", "No cat sat."), ("Some dogs bark.", "All dogs bark."),
             ("It rained.", "The ground is wet.")]
    indices = [0, 1, 1103]
    expected = [Example(a, b, None, index) for (a, b), index in zip(pairs, indices)]
    write_tsv(tmp_path / "diagnostic/diagnostic.tsv", HEADERS["AX", "test"],
              [[index, a, b] for (a, b), index in zip(pairs, indices)])
    assert read_diagnostic(tmp_path / "diagnostic/diagnostic.tsv") == expected
    # the hub's ax config: one test split, MNLI's columns and ClassLabel, label -1
    test = datasets.Dataset.from_dict(
        {"premise": [a for a, _ in pairs], "hypothesis": [b for _, b in pairs],
         "label": [-1] * 3, "idx": indices}, features=MNLI_HUB_FEATURES)
    datasets.DatasetDict(test=test).save_to_disk(tmp_path / "ax")
    assert read_diagnostic(str(tmp_path / "ax")) == expected
    (tmp_path / "ax_hub").mkdir()
    test.to_parquet(tmp_path / "ax_hub/test-00000-of-00001.parquet")
    assert read_diagnostic(tmp_path / "ax_hub") == expected


def test_diagnostic_set_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"diagnostic.tsv: no such file or directory; "
                                                r"expected GLUE's diagnostic/diagnostic.tsv"):
        read_diagnostic(tmp_path / "diagnostic.tsv")
    write_tsv(tmp_path / "diagnostic.tsv", ["index", "sentence1"], [[0, "a"]])
    with pytest.raises(ValueError, match=r"diagnostic.tsv: no column 'sentence2'; the header has "
                                         r"\['index', 'sentence1'\]"):
        read_diagnostic(tmp_path / "diagnostic.tsv")
    write_tsv(tmp_path / "diagnostic.tsv", HEADERS["AX", "test"], [[0, "a", "b"], ["x1", "c", "d"]])
    with pytest.raises(ValueError, match=r"diagnostic.tsv:3: test example index 'x1' is not an "
                                         r"integer"):
        read_diagnostic(tmp_path / "diagnostic.tsv")
    # GLUE's column names instead of the hub's
    (tmp_path / "ax").mkdir()
    datasets.Dataset.from_dict({"sentence1": ["a"], "sentence2": ["b"], "label": [-1],
                                "idx": [0]}).to_json(tmp_path / "ax/test.jsonl")
    with pytest.raises(ValueError, match=r"test.jsonl: no column 'premise' for AX"):
        read_diagnostic(tmp_path / "ax")
    datasets.Dataset.from_dict({"premise": ["a"], "hypothesis": ["b"], "label": [-1]}) \
        .to_json(tmp_path / "ax/test.jsonl")
    with pytest.raises(ValueError, match=r"test.jsonl: no column 'idx' for AX"):
        read_diagnostic(tmp_path / "ax")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no split test"):
        read_diagnostic(tmp_path / "empty")


# ------------------------------------------------------------------------------- features


class WordTokenizer:
    """Stand-in for megatron_2bw.data.tokenizers: one id per whitespace-separated word."""
    pad, cls, sep = 0, 1, 2

    def __init__(self):
        self.vocabulary: dict[str, int] = {}

    def tokenize(self, text: str) -> list[int]:
        return [self.vocabulary.setdefault(word, 10 + len(self.vocabulary)) for word in text.split()]


def test_pair_and_single_features():
    tokenizer = WordTokenizer()
    features = build_features([Example("a b", "c", 2), Example("d", None, 0)], tokenizer, 8)
    a, b, c, d = (tokenizer.vocabulary[w] for w in "abcd")
    np.testing.assert_array_equal(features["text"], [[1, a, b, 2, c, 2, 0, 0],
                                                     [1, d, 2, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(features["types"], [[0, 0, 0, 0, 1, 1, 0, 0],
                                                      [0, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(features["padding_mask"], [[1, 1, 1, 1, 1, 1, 0, 0],
                                                             [1, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(features["label"], [2, 0])
    assert {name: array.dtype for name, array in features.items()} == {
        "text": np.int64, "types": np.int64, "padding_mask": np.int64, "label": np.int64}


def test_longest_first_truncation():
    tokenizer = WordTokenizer()
    words = [f"w{i}" for i in range(20)]
    ids = tokenizer.tokenize(" ".join(words))
    long_a, short_b = " ".join(words[:10]), " ".join(words[10:12])
    # budget 9 - 3 = 6 tokens: a is cut to 4 and b (shorter) keeps its 2
    features = build_features([Example(long_a, short_b, 1)], tokenizer, 9)
    assert features["text"][0].tolist() == [1, *ids[:4], 2, *ids[10:12], 2]
    # both long: the budget 7 is split 4 (a) / 3 (b), cutting b on ties
    features = build_features([Example(long_a, " ".join(words[10:20]), 1)], tokenizer, 10)
    assert features["text"][0].tolist() == [1, *ids[:4], 2, *ids[10:13], 2]
    assert features["types"][0].tolist() == [0] * 6 + [1] * 4
    # a single sentence keeps seq_length - 2 tokens
    features = build_features([Example(long_a, None, 1)], tokenizer, 5)
    assert features["text"][0].tolist() == [1, *ids[:3], 2]
    with pytest.raises(ValueError, match="seq_length must be at least 3"):
        build_features([Example("a", "b", 0)], tokenizer, 2)


def test_regression_and_unlabeled_features():
    features = build_features([Example("a", "b", 4.5), Example("c", "d", None)], WordTokenizer(), 6)
    assert features["label"].dtype == np.float32
    assert features["label"][0] == 4.5 and math.isnan(features["label"][1])
    features = build_features([Example("a", "b", None)], WordTokenizer(), 6)
    assert features["label"].tolist() == [-1]


# -------------------------------------------------------------------------------- metrics


def test_task_metrics():
    assert task_metrics("CoLA", [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]) == {"mcc": pytest.approx(1 / 6)}
    assert task_metrics("MRPC", [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]) == {
        "f1": pytest.approx(2 / 3), "accuracy": pytest.approx(3 / 5)}
    assert task_metrics("MNLI", [0, 2, 1], [0, 2, 2]) == {"accuracy": pytest.approx(2 / 3)}
    assert task_metrics("STS-B", [1.0, 2.0, 3.0], [1.5, 2.5, 5.0]) == {
        "pearson": pytest.approx(np.corrcoef([1, 2, 3], [1.5, 2.5, 5])[0, 1]),
        "spearman": pytest.approx(1.0)}


# ------------------------------------------------------------------ GLUE server submission files


def test_submission_file_names():
    mnli = get_task("MNLI")
    assert [mnli.submission_file(split) for split in mnli.test_splits] == ["MNLI-m.tsv",
                                                                           "MNLI-mm.tsv"]
    assert [task.submission_file("test") for name, task in TASKS.items() if name != "MNLI"] == [
        "QQP.tsv", "QNLI.tsv", "SST-2.tsv", "CoLA.tsv", "STS-B.tsv", "MRPC.tsv", "RTE.tsv",
        "WNLI.tsv"]
    with pytest.raises(ValueError, match=r"RTE has no test split 'dev'; expected one of "
                                         r"\('test',\)"):
        get_task("RTE").submission_file("dev")


def test_submission_rows_hold_file_indices_and_label_strings():
    # the server's label strings are the TSV files' (GlueTask.labels): MNLI's by name, CoLA's 0/1
    assert submission_tsv("MNLI", [9, 2, 40], np.array([1, 2, 0])) == (
        "index\tprediction\n9\tentailment\n2\tneutral\n40\tcontradiction\n")
    assert submission_tsv("QNLI", [5, 6], [1, 0]) == (
        "index\tprediction\n5\tnot_entailment\n6\tentailment\n")
    assert submission_tsv("CoLA", [100, 7], [0, 1]) == "index\tprediction\n100\t0\n7\t1\n"
    assert submission_tsv("WNLI", [0, 1], [1, 0]) == "index\tprediction\n0\t1\n1\t0\n"
    with pytest.raises(ValueError, match="SST-2: 1 predictions for 2 test examples"):
        submission_tsv("SST-2", [0, 1], [1])


def test_sts_b_scores_are_clipped_to_the_server_range():
    assert submission_tsv("STS-B", [3, 1, 4], np.array([-0.4, 2.34567, 5.7], dtype=np.float32)) == (
        "index\tprediction\n3\t0.000\n1\t2.346\n4\t5.000\n")


# ---------------------------------------------------------------------- results table and script


def fabricated_results(task: str, scores_per_epoch: list[float]) -> dict:
    spec = get_task(task)
    return {"task": spec.name, "metric_names": list(spec.metric_names), "epochs": [
        {"epoch": epoch, "split": split, "metrics": {name: score for name in spec.metric_names}}
        for epoch, score in enumerate(scores_per_epoch, start=1) for split in spec.dev_splits]}


def test_results_table_shows_last_epoch(tmp_path):
    (tmp_path / "MNLI.json").write_text(json.dumps(fabricated_results("MNLI", [0.5, 0.8125])))
    (tmp_path / "STS-B.json").write_text(json.dumps(fabricated_results("STS-B", [0.25])))
    lines = format_results_table([tmp_path / "MNLI.json", tmp_path / "STS-B.json"]).splitlines()
    assert [line.split() for line in lines] == [
        ["task", "split", "epoch", "metric", "value"],
        ["MNLI", "dev_matched", "2", "accuracy", "0.8125"],
        ["MNLI", "dev_mismatched", "2", "accuracy", "0.8125"],
        ["STS-B", "dev", "1", "pearson", "0.2500"],
        ["STS-B", "dev", "1", "spearman", "0.2500"]]
    (tmp_path / "bad.json").write_text(json.dumps({"task": "RTE", "epochs": []}))
    with pytest.raises(ValueError, match="bad.json: not a finetune_glue results file"):
        format_results_table([tmp_path / "bad.json"])
    with pytest.raises(FileNotFoundError, match="gone.json"):
        format_results_table([tmp_path / "gone.json"])


FAKE_TORCHRUN = """#!{python}
# Stands in for `torchrun tools/finetune_glue.py ...`: records its arguments, writes results.
import json, sys
from megatron_2bw.evaluation.glue import get_task

args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps(args) + "\\n")
spec = get_task(args[args.index("--task") + 1])
epochs = int(args[args.index("--epochs") + 1])
results = {{"task": spec.name, "metric_names": list(spec.metric_names), "epochs": [
    {{"epoch": e, "split": s, "metrics": {{m: e / 10 for m in spec.metric_names}}}}
    for e in range(1, epochs + 1) for s in spec.dev_splits]}}
with open(args[args.index("--results") + 1], "w") as f:
    json.dump(results, f)
"""


def test_evaluate_glue_script_runs_each_task_and_prints_table(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "torchrun.log"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN.format(python=sys.executable, log=str(log)))
    (bin_dir / "torchrun").chmod(0o755)
    # GLUE's diagnostic set, which only the MNLI run predicts
    diagnostic = tmp_path / "glue data/diagnostic/diagnostic.tsv"
    write_tsv(diagnostic, HEADERS["AX", "test"], [[0, "a", "b"]])
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": sys.executable, "TASKS": "MNLI CoLA MRPC", "TP": "2", "EPOCHS": "3",
           "CHECKPOINT_DIR": str(tmp_path / "ckpt"), "GLUE_DIR": str(tmp_path / "glue data"),
           "RESULTS_DIR": str(tmp_path / "results"),
           "TEST_PREDICTIONS": str(tmp_path / "my submission")}  # a space: quoted in the script
    run = subprocess.run(["bash", str(REPO_ROOT / "examples/evaluate_glue.sh")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 3
    first = calls[0]
    assert first[:4] == ["--standalone", "--nproc-per-node", "2",
                         str(REPO_ROOT / "tools/finetune_glue.py")]
    flags = dict(zip(first[4::2], first[5::2]))
    assert flags["--task"] == "MNLI" and flags["--data-dir"] == str(tmp_path / "glue data/MNLI")
    assert flags["--load"] == str(tmp_path / "ckpt")
    assert flags["--results"] == str(tmp_path / "results/MNLI.json")
    assert flags["--tensor-model-parallel-size"] == "2" and flags["--epochs"] == "3"
    assert flags["--test-predictions"] == str(tmp_path / "my submission")
    assert flags["--diagnostic-data"] == str(diagnostic)
    assert all("--diagnostic-data" not in call and "--test-predictions" in call
               for call in calls[1:])
    assert {"--lr", "--micro-batch-size", "--seed"} <= set(flags)
    # the tokenizer and model shape come from the checkpoint unless TOKENIZER_ARGS/MODEL_ARGS say
    assert not {"--tokenizer-type", "--vocab-file", "--num-layers", "--hidden-size"} & set(flags)

    table = [line.split() for line in run.stdout.splitlines()[-6:]]
    assert table == [["task", "split", "epoch", "metric", "value"],
                     ["MNLI", "dev_matched", "3", "accuracy", "0.3000"],
                     ["MNLI", "dev_mismatched", "3", "accuracy", "0.3000"],
                     ["CoLA", "dev", "3", "mcc", "0.3000"],
                     ["MRPC", "dev", "3", "f1", "0.3000"],
                     ["MRPC", "dev", "3", "accuracy", "0.3000"]]
