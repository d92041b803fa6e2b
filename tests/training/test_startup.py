"""Start-up: what the flags name on disk checked before any process group exists (one line,
exit code 2), and --deterministic-mode on from the start."""
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.data.helpers import write_dataset
from tests.distributed_helpers import run_ranks
from megatron_2bw.arguments import parse_config
from megatron_2bw.config import ConfigError
from megatron_2bw.training.startup import check_inputs
from tests.training.runs import MODEL, ROOT, TINY, pretrain_recording


@pytest.mark.parametrize("extra,expected", [
    (["--data-path", "{tmp}/corpus"], "{tmp}/corpus.idx not found (a dataset prefix names "
     "PREFIX.bin and PREFIX.idx, as tools/preprocess_data.py writes them; did you mean "
     "{tmp}/corpus_text_document?)"),
    (["--data-path", "0.5", "A", "B"], "--data-path expects PREFIX or W1 PREFIX1 W2 PREFIX2"),
    (["--data-path", "{tmp}/corpus_text_document", "--split", "1,2,3,4"],
     "--split expects up to three non-negative weights"),
    (["--data-path", "{tmp}/corpus_text_document"], "--tokenizer-type is required"),
    (["--data-path", "{tmp}/corpus_text_document", "--tokenizer-type", "SentencePieceTokenizer",
      "--tokenizer-model", "{tmp}/none.model"], "--tokenizer-model {tmp}/none.model: file not found"),
    (["--mock-data", "--vocab-size", "64", "--save", "{tmp}/a_file/ckpt"],
     "--save {tmp}/a_file/ckpt: cannot be created ({tmp}/a_file is not a writable directory)"),
    (["--mock-data", "--vocab-size", "64", "--log-file", "{tmp}"], "--log-file {tmp}: exists and is "
     "a directory"),
    (["--mock-data", "--vocab-size", "64", "--auto-parallel", "--planner-hardware", "foo"],
     "--planner-hardware: hardware file 'foo' not found"),
    (["--mock-data", "--vocab-size", "64", "--save", "{tmp}/dangling"],
     "--save {tmp}/dangling: a symbolic link to nothing"),
    (["--data-path", "{tmp}/corpus_text_document", "--tokenizer-type", "GPT2BPETokenizer",
      "--vocab-file", "{tmp}/a_file", "--merge-file", "{tmp}/a_file"],
     "--tokenizer-type GPT2BPETokenizer: "),  # an empty vocabulary: the library's own message
])
def test_what_the_flags_name_on_disk_is_checked_before_start_up(extra, expected, tmp_path):
    write_dataset(tmp_path / "corpus_text_document", [[list(range(40))]])
    (tmp_path / "a_file").write_bytes(b"")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    argv = [a.format(tmp=tmp_path) for a in [*MODEL, *extra]]
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), result.stderr
    assert expected.format(tmp=tmp_path) in lines[0]


def _damage(prefix, how):
    """Writes a 20-document dataset at `prefix`, then damages it `how`."""
    rng = np.random.default_rng(0)
    documents = {"short": [[list(range(10))]], "no documents": []}.get(
        how, [[rng.integers(0, 60, 50).tolist()] for _ in range(20)])
    write_dataset(prefix, documents)
    idx, data = f"{prefix}.idx", f"{prefix}.bin"
    if how == "empty .idx":
        open(idx, "wb").close()
    elif how == "garbage .idx":
        with open(idx, "wb") as f:
            f.write(bytes(range(7, 250)))
    elif how == "truncated .idx":
        os.truncate(idx, 100)
    elif how == "truncated .bin":
        os.truncate(data, 1000)


@pytest.mark.parametrize("how,extra,expected", [
    ("empty .idx", [], "--data-path {p}: {p}.idx is not a Megatron indexed-dataset index: it "
                       "does not start with the magic bytes"),
    ("garbage .idx", [], "--data-path {p}: {p}.idx is not a Megatron indexed-dataset index"),
    ("truncated .idx", [], "--data-path {p}: {p}.idx is truncated: 100 bytes, but its header "
                           "announces 20 sequences and 21 document indices (442 bytes)"),
    ("truncated .bin", [], "--data-path {p}: {p}.bin has 1000 bytes but {p}.idx describes 4000 "
                           "bytes of int32 tokens: the .bin is truncated"),
    ("short", [], "--data-path {p}: the train split of the data has 10 tokens, fewer than "
                  "--seq-length + 1 = 17 (one sample)"),
    ("short", ["--eval-iters", "0", "--split", "0,1,0", "--skip-train"], None),  # nothing read
    ("intact", ["--train-data-path", "{p}", "--seq-length", "1000", "--max-position-embeddings",
                "1000"], "--train-data-path {p}: the data has 1000 tokens, fewer than "
                         "--seq-length + 1 = 1001 (one sample)"),
    ("no documents", [], "--data-path {p}: the dataset holds no documents (was "
                         "tools/preprocess_data.py given an empty input?)"),
    ("intact", ["--split", "0,1,0"], "--split 0,1,0 gives the train split of --data-path no "
                                     "documents"),
])
def test_damaged_or_too_small_data_is_refused_before_start_up(how, extra, expected, tmp_path):
    """Checked on every rank before the process groups and the model (check_inputs): one line
    naming the flag and the file; the run itself is stopped before it starts."""
    prefix = str(tmp_path / "corpus_text_document")
    _damage(prefix, how)
    data = [] if "--train-data-path" in extra else ["--data-path", prefix]
    config = parse_config([*MODEL, "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
                           *data, *(a.format(p=prefix) for a in extra)])[0]
    if expected is None:
        check_inputs(config)
        return
    with pytest.raises(ConfigError) as error:
        check_inputs(config)
    assert str(error.value).startswith(expected.format(p=prefix)), error.value


def test_bert_with_a_tokenizer_without_bert_tokens_is_refused_before_start_up(tmp_path):
    write_dataset(tmp_path / "corpus_text_document", [[[0, 1]]])
    (tmp_path / "vocab.json").write_text('{"a": 0, "b": 1}')
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    result = subprocess.run(
        [sys.executable, "pretrain_bert.py", *MODEL, "--data-path",
         str(tmp_path / "corpus_text_document"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == ("pretrain_bert.py: error: --tokenizer-type GPT2BPETokenizer: "
                                     "GPT2BPETokenizer has no cls token; its vocabulary must define "
                                     "one (one of [CLS], <CLS>, <cls>) for this use")


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_mode_is_on_from_setup(deterministic, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the forked rank inherits it

    def run(rank, world, flags):
        events, _ = pretrain_recording(rank, world, flags)
        return ({on for kind, *rest in events if kind == "step" for on in rest[2:]},
                os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    modes, cublas = run_ranks(1, run, [*TINY, *(["--deterministic-mode"] * deterministic)])[0]
    assert modes == {deterministic}
    assert cublas == (":4096:8" if deterministic else None)
