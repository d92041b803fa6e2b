import random

import pytest

from megatron_2bw.config import DataConfig
from megatron_2bw.data.tokenizers import build_tokenizer
from tests.data.helpers import WORDS, load_tool, random_text

TEXT = "The king hath a sweet crown. Thou speak of love!"


def test_sentencepiece_trained_by_our_tool(spm_model):
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer",
                                           tokenizer_model=str(spm_model)))
    assert tokenizer.vocab_size == 80
    ids = tokenizer.tokenize(TEXT)
    assert ids and max(ids) < 80 and tokenizer.detokenize(ids) == TEXT
    # the tool defines every special token the GPT and BERT datasets need, all distinct
    specials = [tokenizer.eod, tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask]
    assert (tokenizer.eod, tokenizer.pad) == (2, 3)
    assert len(set(specials)) == 5 and max(specials) < 80
    assert not set(specials) & set(ids)  # control symbols never come out of ordinary text


def test_byte_level_bpe_trained_by_our_tool(tmp_path):
    rng = random.Random(2)
    (tmp_path / "text.txt").write_text("\n".join(random_text(rng, 2) for _ in range(200)))
    written = load_tool("train_tokenizer").main([
        "--input", str(tmp_path / "text.txt"), "--output-prefix", str(tmp_path / "bpe"),
        "--vocab-size", "400", "--byte-level-bpe"])
    assert sorted(written) == [str(tmp_path / "bpe-merges.txt"), str(tmp_path / "bpe-vocab.json")]
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer",
                                           vocab_file=str(tmp_path / "bpe-vocab.json"),
                                           merge_file=str(tmp_path / "bpe-merges.txt")))
    assert tokenizer.vocab_size == 400 and tokenizer.eod == 0  # <|endoftext|>
    unusual = TEXT + "\n  naïve ünïcödé 漢字 🙂"  # byte-level: anything round-trips
    assert tokenizer.detokenize(tokenizer.tokenize(unusual)) == unusual
    assert len(tokenizer.tokenize("the king")) < len("the king")  # merges were learned
    with pytest.raises(ValueError, match="GPT2BPETokenizer has no mask token"):
        tokenizer.mask


def _wordpiece_vocab(path):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "The", ".", "!", "##s"] + WORDS
    path.write_text("\n".join(tokens) + "\n")
    return {token: i for i, token in enumerate(tokens)}


def test_wordpiece_lower_and_cased(tmp_path):
    vocab = _wordpiece_vocab(tmp_path / "vocab.txt")
    lower = build_tokenizer(DataConfig(tokenizer_type="BertWordPieceLowerCase",
                                       vocab_file=str(tmp_path / "vocab.txt")))
    cased = build_tokenizer(DataConfig(tokenizer_type="BertWordPieceCase",
                                       vocab_file=str(tmp_path / "vocab.txt")))
    assert lower.vocab_size == len(vocab)
    assert lower.tokenize("The KING kings.") == [vocab["the"], vocab["king"], vocab["king"],
                                                 vocab["##s"], vocab["."]]
    assert cased.tokenize("The KING") == [vocab["The"], vocab["[UNK]"]]
    assert lower.detokenize(lower.tokenize("The king kings!")) == "the king kings!"
    assert (lower.cls, lower.sep, lower.mask, lower.pad) == (2, 3, 4, 0)
    assert lower.eod == lower.sep  # BERT vocabularies end documents with [SEP]


def test_huggingface_tokenizer_from_local_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "</s>": 5}
    vocab.update({word: i + 6 for i, word in enumerate(WORDS)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                            cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                            eos_token="</s>").save_pretrained(tmp_path / "hf")
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer",
                                           tokenizer_model=str(tmp_path / "hf")))
    assert tokenizer.vocab_size == len(vocab)
    assert tokenizer.tokenize("the king") == [vocab["the"], vocab["king"]]
    assert tokenizer.detokenize([vocab["sweet"], vocab["love"]]) == "sweet love"
    assert (tokenizer.eod, tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (5, 1, 2, 3, 4)


def test_null_tokenizer_and_mock_fallback():
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), vocab_size=100)
    assert tokenizer.vocab_size == 101 and tokenizer.eod == 100  # Megatron appends eod
    assert tokenizer.tokenize(" 5 7\n99 ") == [5, 7, 99]
    assert tokenizer.detokenize([5, 7]) == "5 7"
    with pytest.raises(ValueError, match="outside"):
        tokenizer.tokenize("5 101")
    with pytest.raises(ValueError, match="whitespace-separated integers"):
        tokenizer.tokenize("five")
    with pytest.raises(ValueError, match="NullTokenizer has no cls token"):
        tokenizer.cls
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"))
    mock = build_tokenizer(DataConfig(mock_data=True), vocab_size=512)
    assert mock.vocab_size == 512  # the model and the mock tokens agree
    with pytest.raises(ValueError, match="--tokenizer-type is required"):
        build_tokenizer(DataConfig())


@pytest.mark.parametrize("config, error, message", [
    (DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file="/nope/vocab.json",
                merge_file="/nope/merges.txt"), FileNotFoundError, "--vocab-file /nope/vocab.json"),
    (DataConfig(tokenizer_type="GPT2BPETokenizer"), ValueError, "needs --vocab-file"),
    (DataConfig(tokenizer_type="BertWordPieceCase", vocab_file="/nope/vocab.txt"),
     FileNotFoundError, "--vocab-file /nope/vocab.txt"),
    (DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nope/spm.model"),
     FileNotFoundError, "--tokenizer-model /nope/spm.model"),
    (DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2"),
     FileNotFoundError, "--tokenizer-model gpt2: no such local directory"),
])
def test_missing_files_name_the_flag(config, error, message):
    with pytest.raises(error, match=message):
        build_tokenizer(config)


def test_missing_merge_file_names_the_flag(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer",
                                   vocab_file=str(tmp_path / "vocab.json"),
                                   merge_file=str(tmp_path / "merges.txt")))


def test_megatron_sentencepiece_names(spm_model):
    """Megatron-LM's Llama2Tokenizer puts <s> before every text; GPTSentencePieceTokenizer encodes
    as SentencePieceTokenizer does. Both end documents with the model's </s>."""
    def build(kind):
        return build_tokenizer(DataConfig(tokenizer_type=kind, tokenizer_model=str(spm_model)))

    plain, gpt, llama = (build(kind) for kind in ("SentencePieceTokenizer",
                                                  "GPTSentencePieceTokenizer", "Llama2Tokenizer"))
    ids = plain.tokenize(TEXT)
    assert gpt.tokenize(TEXT) == ids and llama.tokenize(TEXT) == [1] + ids  # <s> is id 1
    assert llama.detokenize(llama.tokenize(TEXT)) == TEXT
    assert plain.eod == gpt.eod == llama.eod == 2
