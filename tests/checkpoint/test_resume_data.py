"""Resuming continues the data where the checkpoint stopped, as Megatron-LM's consumed-sample
counts do: with another --global-batch-size no training sample is skipped or read twice, and the
validation stream goes on instead of starting over. A resumed run with no iteration left says so."""
import json
import subprocess
import sys

import numpy as np

from megatron_2bw.arguments import parse_config
from megatron_2bw.data import gpt_dataset
from megatron_2bw.training.loop import pretrain
from tests.data.helpers import write_dataset
from tests.distributed_helpers import run_ranks
from tests.training.runs import ROOT

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
         "--seq-length", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--lr-decay-iters", "10",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--split", "50,50,0",
         "--eval-interval", "1", "--eval-iters", "1", "--log-interval", "1",
         "--distributed-timeout-minutes", "1"]


def _corpus(tmp_path) -> str:
    rng = np.random.default_rng(0)
    documents = [[rng.integers(0, 63, size=int(rng.integers(20, 60)))] for _ in range(40)]
    return write_dataset(tmp_path / "corpus", documents)


def _train_twice_recording_samples(rank, world, prefix, root):
    """Train 3 iterations of batches of 4 (saving), then resume to iteration 5 with batches of 8;
    returns the dataset indices this rank read, per split, in order."""
    read = {}
    original = gpt_dataset.GPTDataset.__getitem__

    def recording(dataset, index):
        read.setdefault(dataset.name, []).append(int(index))
        return original(dataset, index)

    gpt_dataset.GPTDataset.__getitem__ = recording  # this forked rank's own class
    flags = [*MODEL, "--data-path", prefix, "--save", f"{root}/ckpt"]
    pretrain(parse_config([*flags, "--train-iters", "3", "--global-batch-size", "4",
                           "--log-file", f"{root}/first.jsonl"])[0])
    pretrain(parse_config([*flags, "--train-iters", "5", "--global-batch-size", "8",
                           "--load", f"{root}/ckpt", "--log-file", f"{root}/second.jsonl"])[0])
    return read


def test_resuming_with_another_batch_size_reads_every_sample_once(tmp_path):
    prefix = _corpus(tmp_path)
    ranks = run_ranks(2, _train_twice_recording_samples, prefix, str(tmp_path), timeout=240)
    train = sorted(i for read in ranks for i in read["train"])
    valid = sorted(i for read in ranks for i in read["valid"])
    # 3 x 4 then 2 x 8 training samples; an evaluation per iteration, of one batch each
    assert train == list(range(3 * 4 + 2 * 8))
    assert valid == list(range(3 * 4 + 2 * 8))
    with open(tmp_path / "second.jsonl") as f:
        consumed = [r["consumed-samples"] for r in map(json.loads, f) if "consumed-samples" in r]
    assert consumed == [3 * 4 + 8, 3 * 4 + 16]


def _run(*flags):
    return subprocess.run([sys.executable, "pretrain_gpt.py", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_train_iters_below_the_checkpoint_is_one_line_and_equal_says_nothing_is_left(tmp_path):
    flags = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
             "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--lr", "1e-3", "--lr-decay-iters", "10", "--mock-data", "--vocab-size", "64",
             "--eval-iters", "0", "--save", str(tmp_path), "--load", str(tmp_path)]
    assert _run(*flags, "--train-iters", "4").returncode == 0
    below = _run(*flags, "--train-iters", "2")
    assert below.returncode == 2, below.stderr
    assert below.stderr == (f"pretrain_gpt.py: error: --train-iters gives 2 iterations, below the "
                            f"iteration of the --load {tmp_path} checkpoint (4): nothing to "
                            f"train; pass more to continue it\n")
    equal = _run(*flags, "--train-iters", "4")
    assert equal.returncode == 0, equal.stderr
    assert f"--load {tmp_path} is at iteration 4, the last of --train-iters: nothing left to " \
           f"train" in equal.stdout
