import json

import pytest

from megatron_2bw.config import DataConfig
from megatron_2bw.data.tokenizers import build_tokenizer
from tests.data.helpers import load_tool

train_tokenizer = load_tool("train_tokenizer")


def test_unigram_from_jsonl_key(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"body": f"Line {i} of the play.\nThe king speaks {i % 7} times.",
                                "text": 5}) + "\n")
    train_tokenizer.main(["--input", str(tmp_path / "docs.jsonl"), "--json-keys", "body",
                          "--output-prefix", str(tmp_path / "uni"), "--vocab-size", "50",
                          "--model-type", "unigram"])
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer",
                                           tokenizer_model=str(tmp_path / "uni.model")))
    assert tokenizer.vocab_size == 50 and tokenizer.mask != tokenizer.cls
    assert tokenizer.detokenize(tokenizer.tokenize("The king speaks.")) == "The king speaks."


def test_vocabulary_too_large_names_the_flag(tmp_path):
    (tmp_path / "tiny.txt").write_text("a b c\n")
    with pytest.raises(ValueError, match=r"--vocab-size 5000 on this input: Vocabulary size too "
                                         r"high \(5000\)\. Please set it to a value <= \d+"):
        train_tokenizer.main(["--input", str(tmp_path / "tiny.txt"), "--output-prefix",
                              str(tmp_path / "t"), "--vocab-size", "5000"])
