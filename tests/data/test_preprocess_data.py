import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_2bw.config import DataConfig
from megatron_2bw.data.indexed import IndexedDataset
from megatron_2bw.data.tokenizers import build_tokenizer
from tests.data.helpers import TOOLS, load_tool

preprocess = load_tool("preprocess_data")


def _run(inputs, prefix, spm_model, *extra):
    return preprocess.main(["--input", *map(str, inputs), "--output-prefix", str(prefix),
                            "--tokenizer-type", "SentencePieceTokenizer",
                            "--tokenizer-model", str(spm_model), *extra])


def _files(prefix_dir):
    return sorted(os.listdir(prefix_dir))


def _read(prefix):
    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))], dataset.document_indices.tolist()


def test_one_and_two_workers_and_partitions_give_identical_files(tmp_path, corpus_jsonl, spm_model,
                                                                 monkeypatch):
    monkeypatch.setattr(preprocess, "CHUNK_BYTES", 2000)  # many chunks, spread over the workers
    outputs = {}
    for name, flags in {"w1": ["--workers", "1"], "w2": ["--workers", "2"],
                        "p2": ["--workers", "2", "--partitions", "2"]}.items():
        stats = _run([corpus_jsonl], tmp_path / name, spm_model, "--append-eod",
                     "--json-keys", "text", "title", *flags)
        assert stats.documents == 200
        outputs[name] = {key: [open(tmp_path / f"{name}_{key}_document{suffix}", "rb").read()
                               for suffix in (".bin", ".idx")] for key in ("text", "title")}
    assert outputs["w1"] == outputs["w2"] == outputs["p2"]
    assert not [f for f in _files(tmp_path) if "tmp" in f]  # partition files were removed

    tokenizer = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer",
                                           tokenizer_model=str(spm_model)))
    sequences, documents = _read(tmp_path / "w2_text_document")
    texts = [json.loads(line)["text"] for line in open(corpus_jsonl)]
    assert sequences == [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts]
    assert documents == list(range(201))
    assert IndexedDataset(str(tmp_path / "w2_text_document")).dtype == np.uint16


@pytest.mark.parametrize("flags", [["--workers", "2"], ["--workers", "2", "--partitions", "2"]])
def test_workers_start_fresh_interpreters_not_forks_of_the_reader(tmp_path, corpus_jsonl,
                                                                  spm_model, monkeypatch, flags):
    """The reading process runs threads (tqdm's monitor, the tokenizer's) and a fork of it can
    deadlock; a worker that inherited this process's state would run the patched encoder."""
    def inherited(self, chunk):
        raise AssertionError("the worker is a fork of the reading process")

    monkeypatch.setattr(preprocess.Encoder, "encode_chunk", inherited)
    assert _run([corpus_jsonl], tmp_path / "o", spm_model, *flags).documents == 200
    texts = [json.loads(line)["text"] for line in open(corpus_jsonl)]
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer",
                                           tokenizer_model=str(spm_model)))
    assert _read(tmp_path / "o_text_document")[0] == [tokenizer.tokenize(t) for t in texts]


def test_split_sentences_writes_sentence_datasets(tmp_path, corpus_jsonl, spm_model):
    _run([corpus_jsonl], tmp_path / "s", spm_model, "--split-sentences", "--workers", "2")
    sequences, documents = _read(tmp_path / "s_text_sentence")
    texts = [json.loads(line)["text"] for line in open(corpus_jsonl)]
    counts = [len(preprocess.split_sentences(t)) for t in texts]
    assert max(counts) == 6 and min(counts) == 1
    assert np.diff(documents).tolist() == counts


def test_sentence_splitter():
    assert preprocess.split_sentences('He said "Go." Then he left! Why? 3 men came.  ') == [
        'He said "Go."', "Then he left!", "Why?", "3 men came."]
    assert preprocess.split_sentences("version 2.5 is out. e.g. this") == [
        "version 2.5 is out. e.g. this"]
    # --keep-newlines: a sentence keeps the line breaks after it (Megatron-LM's flag)
    text = "First line ends.\nSecond one. Same line!\n\n  Last paragraph."
    assert preprocess.split_sentences(text) == ["First line ends.", "Second one.", "Same line!",
                                                "Last paragraph."]
    assert preprocess.split_sentences(text, keep_newlines=True) == [
        "First line ends.\n", "Second one.", "Same line!\n\n", "Last paragraph."]


def test_every_input_format_gives_the_same_tokens(tmp_path, spm_model):
    rows = [{"text": f"The king hath {i} crowns.", "title": str(i)} for i in range(30)]
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "rows.json", "w") as f:
        json.dump(rows, f, indent=1)  # a JSON array spread over many lines
    with open(tmp_path / "rows.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["text", "title"])
        writer.writeheader()
        writer.writerows(rows)
    (tmp_path / "rows.txt").write_text("\n".join(r["text"] for r in rows) + "\n\n")
    import datasets
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    with open(tmp_path / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:10])
    with open(tmp_path / "rows2.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[10:])

    expected = None
    for name, inputs in {"json": [tmp_path / "in" / "rows.json"], "csv": [tmp_path / "rows.csv"],
                         "txt": [tmp_path / "rows.txt"], "parquet": [tmp_path / "rows.parquet"],
                         "saved": [tmp_path / "saved"],
                         "jsonl2": [tmp_path / "rows.jsonl", tmp_path / "rows2.jsonl"],
                         "dir": [tmp_path / "in"]}.items():
        _run(inputs, tmp_path / f"out_{name}", spm_model)
        sequences, _ = _read(tmp_path / f"out_{name}_text_document")
        expected = expected or sequences
        assert sequences == expected and len(sequences) == 30, name


@pytest.mark.parametrize("flags", [["--workers", "1"], ["--workers", "2"],
                                   ["--workers", "2", "--partitions", "2"]])
def test_bad_records_name_the_line_and_leave_no_output(tmp_path, corpus_jsonl, spm_model, flags,
                                                       monkeypatch):
    # small chunks: the reader is still blocked on a full read-ahead window when the error comes
    monkeypatch.setattr(preprocess, "CHUNK_BYTES", 500)
    lines = open(corpus_jsonl).read().splitlines()
    lines[56] = '{"text": "broken'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 57: invalid JSON"):
        _run([bad], tmp_path / "out", spm_model, *flags)
    with pytest.raises(ValueError, match=r"corpus\.jsonl: line 1: the record has no key 'body'"):
        _run([corpus_jsonl], tmp_path / "out", spm_model, *flags, "--json-keys", "body")
    assert _files(tmp_path) == before  # no output, complete-looking or temporary


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, corpus_jsonl):
    script = str(TOOLS / "preprocess_data.py")
    for flags, message in [
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
          "--merge-file", "m.txt"], "--vocab-file " + str(tmp_path / "vocab.json")),
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--workers", "0"],
         "--workers must be >= 1"),
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--lang", "german"],
         "--lang german: the sentence rule here splits at . ! ? before a capital letter"),
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(corpus_jsonl)],
         f"--tokenizer-model {corpus_jsonl}: not a SentencePiece model (INTERNAL: could not "
         f"parse ModelProto from {corpus_jsonl})"),
    ]:
        result = subprocess.run([sys.executable, script, "--input", str(corpus_jsonl),
                                 "--output-prefix", str(tmp_path / "o"), *flags],
                                capture_output=True, text=True)
        assert result.returncode == 2
        assert result.stderr.startswith("preprocess_data.py: error: ") and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert _files(tmp_path) == ["corpus.jsonl"]


@pytest.mark.parametrize("text", ["", '{"text": ""}\n{"text": ""}\n'], ids=["empty", "no text"])
@pytest.mark.parametrize("flags", [["--workers", "1"], ["--workers", "2", "--partitions", "2"]])
def test_an_input_without_text_is_refused_and_writes_nothing(tmp_path, spm_model, text, flags):
    """A dataset of 0 documents would fail only in training, after the model is built."""
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=r"^--input .*a\.jsonl .*b\.jsonl: no text under "
                                         r"--json-keys text \(empty input, or no record with "
                                         r"that key\); nothing was written$"):
        _run([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "out", spm_model, *flags)
    assert _files(tmp_path) == ["a.jsonl", "b.jsonl"]


def test_megatron_scripts_flags_are_accepted(tmp_path, corpus_jsonl):
    """Older Megatron-LM scripts' --vocab and --dataset-impl mmap, and --log-interval."""
    args = preprocess.get_args(["--input", str(corpus_jsonl), "--output-prefix", "o",
                                "--tokenizer-type", "BertWordPieceLowerCase", "--vocab", "v.txt",
                                "--dataset-impl", "mmap", "--log-interval", "100"])
    assert args.vocab_file == "v.txt"
    with pytest.raises(SystemExit):
        preprocess.get_args(["--input", str(corpus_jsonl), "--output-prefix", "o",
                             "--tokenizer-type", "NullTokenizer", "--dataset-impl", "lazy"])
    args = preprocess.get_args(["--input", str(corpus_jsonl), "--output-prefix", "o",
                                "--tokenizer-type", "NullTokenizer", "--split-sentences",
                                "--keep-newlines", "--lang", "english"])
    assert args.keep_newlines and args.lang == "english"


def test_missing_input_and_unsupported_type(tmp_path, spm_model):
    with pytest.raises(FileNotFoundError, match="--input .*nothing.jsonl"):
        _run([tmp_path / "nothing.jsonl"], tmp_path / "o", spm_model)
    (tmp_path / "a.xml").write_text("<a/>")
    with pytest.raises(ValueError, match="unsupported file type"):
        _run([tmp_path / "a.xml"], tmp_path / "o", spm_model)
    (tmp_path / "array.json").write_text('[{"text": "a b"},\n{"text": "c d"},\n{"text": "broken')
    with pytest.raises(ValueError, match=r"array\.json: invalid JSON at character 44"):
        _run([tmp_path / "array.json"], tmp_path / "o", spm_model, "--workers", "2")
    assert sorted(os.listdir(tmp_path)) == ["a.xml", "array.json"]


def _identity(x):
    return x


def test_reading_waits_for_the_workers():
    """Pool.imap would read the whole input ahead; ReadAhead keeps only a few chunks in flight,
    and closing it lets the pool be torn down while the reader waits."""
    produced = []

    def endless():
        while True:
            produced.append(len(produced))
            yield produced[-1]

    read_ahead = preprocess.ReadAhead(4)
    with preprocess.PROCESSES.Pool(2) as pool:  # the tool's: a fork of pytest's threads can hang
        results = pool.imap(_identity, read_ahead.feed(endless()))
        for expected in range(10):
            assert next(results) == expected
            read_ahead.consumed()
        read_ahead.close()
        pool.terminate()
    assert len(produced) <= 10 + 4 + 1


def test_merge_datasets(tmp_path, corpus_jsonl, spm_model):
    lines = open(corpus_jsonl).read().splitlines(keepends=True)
    (tmp_path / "parts").mkdir()
    for i, part in enumerate((lines[:70], lines[70:])):
        (tmp_path / f"part{i}.jsonl").write_text("".join(part))
        _run([tmp_path / f"part{i}.jsonl"], tmp_path / "parts" / f"p{i}", spm_model)
    _run([corpus_jsonl], tmp_path / "whole", spm_model)
    merge = load_tool("merge_datasets")
    merge.main(["--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "merged")])
    assert _read(tmp_path / "merged") == _read(tmp_path / "whole_text_document")
    with pytest.raises(FileNotFoundError, match="neither a directory nor a dataset prefix"):
        merge.main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "m2")])
