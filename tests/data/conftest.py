"""Fixtures of the data tests: small generated corpora and tokenizers, all in tmp paths."""
import json
import random

import pytest

from tests.data.helpers import load_tool, random_text


@pytest.fixture
def corpus_jsonl(tmp_path):
    """200 documents of 1-6 generated sentences, {"text", "title"} per line."""
    rng = random.Random(0)
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": random_text(rng, rng.randint(1, 6)), "title": f"doc {i}"})
                    + "\n")
    return path


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory):
    """A tiny SentencePiece model trained by tools/train_tokenizer.py on generated text."""
    directory = tmp_path_factory.mktemp("spm")
    rng = random.Random(1)
    (directory / "text.txt").write_text("\n".join(random_text(rng, 3) for _ in range(300)) + "\n")
    load_tool("train_tokenizer").main(["--input", str(directory / "text.txt"), "--output-prefix",
                                       str(directory / "spm"), "--vocab-size", "80"])
    return directory / "spm.model"
