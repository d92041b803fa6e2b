"""Start-up: what the flags name on disk checked before any process group exists (one line,
exit code 2), and --deterministic-mode on from the start."""
import os
import subprocess
import sys

import pytest

from tests.distributed_helpers import run_ranks
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
    for name in ("corpus_text_document.idx", "corpus_text_document.bin", "a_file"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    argv = [a.format(tmp=tmp_path) for a in [*MODEL, *extra]]
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), result.stderr
    assert expected.format(tmp=tmp_path) in lines[0]


def test_bert_with_a_tokenizer_without_bert_tokens_is_refused_before_start_up(tmp_path):
    for name in ("corpus_text_document.idx", "corpus_text_document.bin"):
        (tmp_path / name).write_bytes(b"")
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
