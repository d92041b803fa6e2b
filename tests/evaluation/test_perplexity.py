"""Perplexity and LAMBADA evaluation: the windows of each protocol, and tools/evaluate_perplexity.py
against the checkpoint's transformers export scored independently (per target, with its context)."""
import json
import os

import numpy as np
import pytest
import torch
import transformers
from tokenizers import ByteLevelBPETokenizer

from megatron_2bw.config import ConfigError, DataConfig
from megatron_2bw.evaluation.perplexity import full_windows, lambada_windows, overlapping_windows
from tests.checkpoint.helpers import VOCAB, save_random_checkpoint
from tests.data.helpers import load_tool, write_dataset
from tests.distributed_helpers import run_ranks

L = 16  # the checkpoint's --seq-length


def test_full_windows_cut_the_stream_into_non_overlapping_windows():
    windows = full_windows(np.arange(70), 16)  # 69 targets: 4 full windows, 5 targets dropped
    assert len(windows) == 4
    assert windows[2].tokens.tolist() == list(range(32, 49)) and windows[2].loss_mask.all()


@pytest.mark.parametrize("length,stride", [(70, 4), (70, 16), (17, 5), (10, 3), (53, 1)])
def test_overlapping_windows_count_every_target_once_with_the_longest_context(length, stride):
    counted = np.zeros(length, dtype=int)
    for i, window in enumerate(overlapping_windows(np.arange(length), L, stride, pad_id=-1)):
        for position in np.flatnonzero(window.loss_mask):
            target = i * stride + position + 1
            assert window.tokens[position + 1] == target  # the window's own token, not padding
            assert position + 1 >= min(target, L - stride + 1)  # context of >= L - K tokens
            counted[target] += 1
    assert counted[0] == 0 and (counted[1:] == 1).all()


def test_lambada_windows_mask_the_last_word_and_keep_the_end_of_long_passages():
    windows, truncated = lambada_windows([([1, 2, 3], [4, 5]), (list(range(20)), [7])], 8, pad_id=0)
    assert windows[0].tokens.tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 0]
    assert windows[0].loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert windows[1].tokens.tolist() == list(range(12, 20)) + [7]
    assert windows[1].loss_mask.tolist() == [0] * 7 + [1]
    assert truncated == 1


# -- the tool against transformers -------------------------------------------------------------------

@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A random GPT (saved t=2 x p=2, a padded vocabulary), its transformers export and a dataset."""
    root = tmp_path_factory.mktemp("perplexity")
    save_random_checkpoint(root / "ckpt", "gpt", t=2, p=2)
    load_tool("export_to_hf").main(["--load", str(root / "ckpt"), "--output", str(root / "hf")])
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", local_files_only=True)
    rng = np.random.RandomState(0)
    documents = [[rng.randint(0, VOCAB - 1, size=rng.randint(5, 30)).tolist() + [VOCAB - 1]]
                 for _ in range(6)]
    prefix = write_dataset(root / "text_document", documents)
    stream = np.concatenate([np.concatenate(d) for d in documents])
    return root, hf.eval(), prefix, stream


def reference_loss(hf, stream: np.ndarray, stride: int | None) -> float:
    """Mean loss per target, each scored from the window start that the protocol gives it."""
    count = (len(stream) - 1) // L * L if stride is None else len(stream) - 1
    by_start: dict[int, list[int]] = {}
    for target in range(1, count + 1):
        if stride is None:
            start = (target - 1) // L * L
        else:
            start = 0 if target <= L else -(-(target - L) // stride) * stride
        by_start.setdefault(start, []).append(target)
    total = 0.0
    with torch.no_grad():
        for start, targets in by_start.items():
            log_probs = hf(torch.tensor(stream[start:start + L])[None]).logits[0].log_softmax(-1)
            total -= sum(log_probs[t - start - 1, stream[t]].item() for t in targets)
    return total / count


@pytest.mark.parametrize("stride", [None, 5])
def test_perplexity_equals_the_transformers_export_on_the_same_windows(evaluated, stride, tmp_path):
    root, hf, prefix, stream = evaluated
    extra = [] if stride is None else ["--overlapping-eval", str(stride)]
    report = load_tool("evaluate_perplexity").main(
        ["--load", str(root / "ckpt"), "--data-path", prefix, "--micro-batch-size", "3",
         "--output", str(tmp_path / "ppl.json"), *extra])
    expected = reference_loss(hf, stream, stride)
    assert report["targets"] == ((len(stream) - 1) // L * L if stride is None else len(stream) - 1)
    assert report["loss"] == pytest.approx(expected, rel=1e-5)
    assert report["perplexity"] == pytest.approx(np.exp(expected), rel=1e-5)
    assert json.loads((tmp_path / "ppl.json").read_text())["perplexity"] == report["perplexity"]


def _evaluate_on_ranks(rank, world, argv):
    return load_tool("evaluate_perplexity").main(argv)


@pytest.mark.parametrize("sequence_parallel", [[], ["--sequence-parallel"]], ids=["", "sp"])
def test_tensor_parallel_evaluation_gives_the_same_perplexity(evaluated, sequence_parallel):
    root, _, prefix, _ = evaluated
    argv = ["--load", str(root / "ckpt"), "--data-path", prefix, "--overlapping-eval", "5"]
    single = load_tool("evaluate_perplexity").main(argv)
    parallel = run_ranks(2, _evaluate_on_ranks, argv + ["--tensor-model-parallel-size", "2",
                                                        *sequence_parallel])
    assert parallel[0]["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert parallel[0]["targets"] == single["targets"]


@pytest.mark.parametrize("strict", [False, True])
def test_lambada_accuracy_counts_passages_whose_last_word_is_the_argmax(evaluated, tmp_path,
                                                                        strict):
    root, hf, _, _ = evaluated
    rng = np.random.RandomState(1)
    lines, expected = [], 0
    for i in range(8):  # mock-data text is token ids; the last one is too long for a window
        context = rng.randint(0, VOCAB - 1, size=30 if i == 7 else rng.randint(3, 12)).tolist()
        with torch.no_grad():
            best = int(hf(torch.tensor(context[-L:])[None]).logits[0, -1, :].argmax())
        answer = best if i % 2 == 0 else (best + 1) % (VOCAB - 1)
        expected += i % 2 == 0
        lines.append(json.dumps({"text": " ".join(map(str, context + [answer]))}))
    (tmp_path / "lambada.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["--load", str(root / "ckpt"), "--task", "lambada", "--input",
            str(tmp_path / "lambada.jsonl")] + (["--strict-lambada"] if strict else [])
    report = load_tool("evaluate_perplexity").main(argv)
    assert (report["examples"], report["correct"]) == (8, expected)
    assert report["accuracy"] == expected / 8 and report["truncated_contexts"] == 1


def test_raw_text_with_the_run_tokenizer_matches_the_exported_tokenizer(tmp_path):
    text = "the king and the queen spoke of love and war in the night " * 12
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=280, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(tmp_path))
    vocab = bpe.get_vocab_size()
    data = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                      merge_file=str(tmp_path / "merges.txt"))
    save_random_checkpoint(tmp_path / "ckpt", "gpt", t=1, p=1, vocab_size=vocab, data=data)
    load_tool("export_to_hf").main(["--load", str(tmp_path / "ckpt"), "--output",
                                    str(tmp_path / "hf")])
    (tmp_path / "text.txt").write_text(text)
    report = load_tool("evaluate_perplexity").main(
        ["--load", str(tmp_path / "ckpt"), "--input", str(tmp_path / "text.txt"),
         "--overlapping-eval", "8"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    stream = np.asarray(tokenizer.encode(text))
    assert tokenizer.eos_token == "<|endoftext|>" and hf.config.eos_token_id == 0
    assert report["loss"] == pytest.approx(reference_loss(hf.eval(), stream, 8), rel=1e-5)
    assert report["token_ratio"] == pytest.approx((len(stream) - 1) / (len(text.strip().split(" ")) - 1))


@pytest.mark.parametrize("damage, message", [
    ("beyond", "--data-path {p}: contains token id 106, but the checkpoint's model has only 101 "
               "ids: the data was preprocessed with another tokenizer"),
    ("truncated", "--data-path {p}: {p}.bin has 8 bytes but {p}.idx describes 12 bytes"),
])
def test_data_the_model_cannot_read_is_one_line_before_the_model_is_built(evaluated, damage,
                                                                           message, tmp_path,
                                                                           monkeypatch):
    root = evaluated[0]
    prefix = write_dataset(tmp_path / "bad_text_document", [[[1, 2, VOCAB + 5]]])
    if damage == "truncated":
        os.truncate(f"{prefix}.bin", 8)
    tool = load_tool("evaluate_perplexity")
    monkeypatch.setattr(tool, "build_model", None)  # reaching it would be a TypeError
    with pytest.raises(ConfigError) as error:
        tool.main(["--load", str(root / "ckpt"), "--data-path", prefix])
    assert str(error.value).startswith(message.format(p=prefix)), error.value
