"""The checkpoint tools from the command line: one-line errors with exit status 2, and an imported
transformers GPT-2 fine-tuned with pretrain's --load --finetune (starting from its exact loss)."""
import runpy
import sys
from pathlib import Path

import pytest
import torch
import transformers

from megatron_2bw.data.builder import build_pretraining_datasets
from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.training.loop import pretrain
from tests.checkpoint.helpers import (VOCAB, config_from_flags, logged_losses, pretrain_flags,
                                      save_random_checkpoint)
from tests.data.helpers import load_tool
from tests.distributed_helpers import run_ranks

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def run_tool(name: str, argv: list[str], monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", [str(TOOLS / f"{name}.py"), *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(TOOLS / f"{name}.py"), run_name="__main__")
    return exit_info.value.code


def relu_gpt2(directory):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=4, activation_function="relu")
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)


@pytest.mark.parametrize("tool,argv,message", [
    ("convert_checkpoint", ["--load", "{ckpt}", "--save", "{tmp}/out"],
     "the following arguments are required: --target-tensor-parallel-size"),
    ("convert_checkpoint", ["--load", "{ckpt}", "--save", "{tmp}/out", "--target-tensor-parallel-size",
                            "3", "--target-pipeline-parallel-size", "1"],
     "--target-tensor-parallel-size 3 must be positive and divide the model's --num-attention-heads 4"),
    ("export_to_hf", ["--load", "{tmp}/missing", "--output", "{tmp}/hf"],
     "checkpoint directory {tmp}/missing does not exist"),
    ("export_to_hf", ["--load", "{ckpt}", "--output", "{tmp}/hf", "--hidden-size", "64"],
     "--hidden-size 64 contradicts checkpoint {ckpt}, whose model has hidden_size = 32"),
    ("export_to_hf", ["--load", "{ckpt}", "--output", "{ckpt}/latest_checkpointed_iteration.txt"],
     "--output {ckpt}/latest_checkpointed_iteration.txt: exists and is not a directory; give a "
     "new or empty directory"),
    ("export_to_hf", ["--load", "{ckpt}", "--output", "{ckpt}"],
     "--output {ckpt}: not empty (2 entries, e.g. iter_0000007); give a new or empty directory, "
     "so that no file of another model is loaded with this one"),
    ("import_from_hf", ["--hf-path", "{tmp}/relu", "--save", "{tmp}/imported"],
     "config.json has activation_function = 'relu'"),
    ("evaluate_perplexity", ["--load", "{ckpt}"],
     "give exactly one of --data-path PREFIX and --input FILE"),
    ("evaluate_perplexity", ["--load", "{ckpt}", "--input", "{tmp}/none.txt",
                             "--pipeline-model-parallel-size", "2"],
     "--pipeline-model-parallel-size must be 1 for evaluation"),
    ("evaluate_perplexity", ["--load", "{ckpt}", "--input", "{tmp}/none.txt",
                             "--context-parallel-size", "2"],
     "--context-parallel-size must be 1 for evaluation"),
])
def test_bad_input_is_one_line_naming_the_flag_and_exit_status_2(tool, argv, message, tmp_path,
                                                                  monkeypatch, capsys):
    save_random_checkpoint(tmp_path / "ckpt", "gpt", t=1, p=1)
    if tool == "import_from_hf":
        relu_gpt2(tmp_path / "relu")
        capsys.readouterr()
    fill = {"ckpt": str(tmp_path / "ckpt"), "tmp": str(tmp_path)}
    assert run_tool(tool, [a.format(**fill) for a in argv], monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{tool}.py: error: "), err
    assert message.format(**fill) in err[0]


def _finetune(rank, world, flags):
    config = config_from_flags(flags)
    pretrain(config)
    tokenizer = build_tokenizer(config.data, config.model.vocab_size)
    train = build_pretraining_datasets(config, tokenizer, (8, 0, 0))[0]
    return torch.stack([torch.from_numpy(train[i]["tokens"]) for i in range(8)])


def test_an_imported_gpt2_fine_tunes_from_its_own_loss(tmp_path):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
        activation_function="gelu", bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))
    hf.save_pretrained(tmp_path / "hf")
    load_tool("import_from_hf").main(["--hf-path", str(tmp_path / "hf"), "--save",
                                      str(tmp_path / "ckpt"), "--make-vocab-size-divisible-by", "8"])
    flags = pretrain_flags(1, 1, 2, "--load", str(tmp_path / "ckpt"), "--finetune",
                           "--hidden-dropout", "0", "--attention-dropout", "0",
                           "--log-file", str(tmp_path / "log.jsonl"))
    first_batch = run_ranks(1, _finetune, flags)[0]
    losses = logged_losses(tmp_path / "log.jsonl")
    assert [i for i, _ in losses] == [1, 2]  # --finetune: iteration 0, fresh optimizer
    with torch.no_grad():  # the 16 targets of each 17-token sample, as pretrain scores them
        logits = hf.eval()(first_batch[:, :-1]).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                     first_batch[:, 1:].reshape(-1))
    assert losses[0][1] == pytest.approx(expected.item(), rel=1e-5)
