"""pretrain_bert.py end to end on real preprocessed data: a generated corpus, a SentencePiece model
trained by tools/train_tokenizer.py, sentence-split indexed data from tools/preprocess_data.py
--split-sentences, then 40 iterations with torchrun on 2 processes (p=2, the default 2BW
schedule). The masked-LM loss falls at every logged interval."""
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

from tests.data.helpers import load_tool

REPO = Path(__file__).resolve().parents[2]
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: (\S+) \| sop loss: (\S+)")


def write_corpus(path: Path, documents: int = 300) -> None:
    """Documents of 3-8 sentences over 120 pseudo-words with Zipf-like frequencies."""
    rng = random.Random(0)
    syllables = "ba ko ti mu ne sa lo ri pe du ga fi".split()
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
                    for _ in range(200)})[:120]
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    with open(path, "w") as f:
        for _ in range(documents):
            sentences = [" ".join(rng.choices(words, weights, k=rng.randint(4, 10))).capitalize()
                         + "." for _ in range(rng.randint(3, 8))]
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")


def test_masked_lm_loss_falls_on_a_sentencepiece_corpus(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    load_tool("train_tokenizer").main(["--input", str(corpus), "--output-prefix",
                                       str(tmp_path / "spm"), "--vocab-size", "200"])
    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer",
                 "--tokenizer-model", str(tmp_path / "spm.model")]
    load_tool("preprocess_data").main(["--input", str(corpus), "--output-prefix",
                                       str(tmp_path / "corpus"), "--split-sentences", *tokenizer])
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
               str(REPO / "pretrain_bert.py"), "--pipeline-model-parallel-size", "2",
               "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "16",
               "--train-iters", "40", "--lr", "1.5e-3", "--lr-warmup-iters", "2",
               "--log-interval", "8", "--eval-interval", "40", "--eval-iters", "2",
               "--data-path", str(tmp_path / "corpus_text_sentence"), "--split", "90,10,0",
               "--data-cache-path", str(tmp_path / "cache"), *tokenizer]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                             timeout=900)
    output = process.stdout + process.stderr
    assert process.returncode == 0, output[-4000:]
    logged = [(int(i), float(lm), float(sop)) for i, lm, sop in LOG_LINE.findall(output)]
    assert [i for i, _, _ in logged] == [8, 16, 24, 32, 40], output[-4000:]
    lm_losses = [lm for _, lm, _ in logged]
    assert all(later < earlier for earlier, later in zip(lm_losses, lm_losses[1:])), lm_losses
    assert lm_losses[-1] < lm_losses[0] - 0.5, lm_losses
    assert all(0.5 < sop < 0.9 for _, _, sop in logged)  # the sentence-order head trains alongside
    assert "validation at iteration 40 | lm loss:" in output
