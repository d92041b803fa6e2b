"""A checkpoint's tokenizer is found from any folder: training records its path absolute, tools
look beside the checkpoint too, and a file found nowhere names --tokenizer-model as the fix."""
import shutil
import subprocess
import sys

import pytest
import sentencepiece
import torch

from megatron_2bw.arguments import build_parser
from megatron_2bw.checkpoint.save_load import saved_config
from megatron_2bw.config import ConfigError
from megatron_2bw.inference.cli import add_generate_arguments
from megatron_2bw.inference.loading import load_text_model
from tests.data.helpers import load_tool
from tests.training.runs import ROOT


def _load(root: str):
    args = build_parser("", add_generate_arguments).parse_args(["--load", root])
    return load_text_model(args, device=torch.device("cpu"), show_progress=False)


def test_tools_find_the_tokenizer_of_a_run_trained_in_another_folder(tmp_path, monkeypatch):
    train = tmp_path / "train"
    train.mkdir()
    lines = ["the king and the queen spoke of love and war in the night"] * 50
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines),
                                             model_prefix=str(train / "spm"), vocab_size=40,
                                             model_type="bpe", minloglevel=2)
    run = subprocess.run(
        [sys.executable, f"{ROOT}/pretrain_gpt.py", "--num-layers", "1", "--hidden-size", "16",
         "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
         "--vocab-size", "40", "--tokenizer-type", "SentencePieceTokenizer",
         "--tokenizer-model", "spm.model", "--eval-iters", "0", "--save", "ckpt"],
        cwd=train, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    root = str(train / "ckpt")
    assert saved_config(root).data.tokenizer_model == str(train / "spm.model")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    expected = _load(root).tokenizer.tokenize("the queen")
    load_tool("export_to_hf").main(["--load", root, "--output", "hf"])  # relative to here
    assert (elsewhere / "hf" / "tokenizer.model").read_bytes() == \
        (train / "spm.model").read_bytes()
    shutil.move(train / "spm.model", train / "ckpt" / "spm.model")  # moved with the checkpoint
    assert _load(root).tokenizer.tokenize("the queen") == expected
    (train / "ckpt" / "spm.model").unlink()
    with pytest.raises(ConfigError) as error:
        _load(root)
    assert str(error.value) == (f"checkpoint {root} was trained with --tokenizer-model "
                                f"{train}/spm.model, which is not found (from {elsewhere}, nor in "
                                f"{root}): pass --tokenizer-model with its path")
