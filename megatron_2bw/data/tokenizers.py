"""Tokenizers behind one interface, selected by Megatron's --tokenizer-type.

Every tokenizer exposes `vocab_size` (the true vocabulary, special tokens included),
`tokenize(text) -> list[int]`, `detokenize(ids) -> str` and the special ids `eod cls sep mask
pad`. A special id the vocabulary lacks raises a ValueError naming the tokenizer and the role
(BERT, for instance, needs cls/sep/mask/pad), so a GPT-only vocabulary fails clearly when used for BERT.
"""
from __future__ import annotations

import os
from typing import Callable

from megatron_2bw.config import DataConfig

SPECIAL_ROLES = ("eod", "cls", "sep", "mask", "pad")
# Megatron-LM's names of a SentencePiece model: GPTSentencePieceTokenizer encodes as is,
# Llama2Tokenizer puts the model's <s> before every document.
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
                   *SENTENCEPIECE_TYPES, "HuggingFaceTokenizer", "NullTokenizer")

# Conventional spellings of each special token, looked up in this order.
_SPECIAL_SPELLINGS = {
    "eod": ("<|endoftext|>", "[EOD]", "<EOD>", "<eod>", "[EOS]", "</s>", "<eos>"),
    "cls": ("[CLS]", "<CLS>", "<cls>"),
    "sep": ("[SEP]", "<SEP>", "<sep>"),
    "mask": ("[MASK]", "<MASK>", "<mask>"),
    "pad": ("[PAD]", "<PAD>", "<pad>"),
}


def _find_specials(token_to_id: Callable[[str], int | None]) -> dict[str, int | None]:
    """Look each role up by its conventional spellings; None where the vocabulary has none."""
    found = {}
    for role, spellings in _SPECIAL_SPELLINGS.items():
        ids = (token_to_id(spelling) for spelling in spellings)
        found[role] = next((i for i in ids if i is not None), None)
    return found


class Tokenizer:
    """Base class: subclasses set `name`, `vocab_size` and `_special_ids` and implement the codec."""

    name: str
    vocab_size: int
    _special_ids: dict[str, int | None]

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    def has(self, role: str) -> bool:
        return self._special_ids.get(role) is not None

    def _special(self, role: str) -> int:
        token_id = self._special_ids.get(role)
        if token_id is None:
            raise ValueError(f"{self.name} has no {role} token; its vocabulary must define one "
                             f"(one of {', '.join(_SPECIAL_SPELLINGS[role])}) for this use")
        return token_id

    eod = property(lambda self: self._special("eod"))
    cls = property(lambda self: self._special("cls"))
    sep = property(lambda self: self._special("sep"))
    mask = property(lambda self: self._special("mask"))
    pad = property(lambda self: self._special("pad"))


class _RustTokenizer(Tokenizer):
    """GPT-2 byte-level BPE and BERT WordPiece, both run by the `tokenizers` library."""

    def __init__(self, name: str, tokenizer, eod_fallback: str | None = None):
        self.name = name
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._special_ids = _find_specials(tokenizer.token_to_id)
        if self._special_ids["eod"] is None and eod_fallback is not None:
            # BERT vocabularies have no end-of-document token; [SEP] ends a segment instead.
            self._special_ids["eod"] = self._special_ids[eod_fallback]

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model. Megatron-LM's Llama2Tokenizer is the same with the model's
    beginning-of-sequence id put before every text (`prepend_bos`)."""

    def __init__(self, model_file: str, name: str = "SentencePieceTokenizer",
                 prepend_bos: bool = False):
        import sentencepiece

        self.name = name
        self._model = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._bos = [self._model.bos_id()] if prepend_bos else []
        if prepend_bos and self._model.bos_id() < 0:
            raise ValueError(f"--tokenizer-type {name}: {model_file} has no beginning-of-sequence "
                             f"piece to put before each document")
        self.vocab_size = self._model.get_piece_size()
        unk = self._model.unk_id()

        def piece_id(piece: str) -> int | None:
            token_id = self._model.piece_to_id(piece)
            return None if token_id == unk else token_id

        self._special_ids = _find_specials(piece_id)
        # The model's own eos/pad ids win over spellings (piece_to_id never finds control pieces
        # that were renamed).
        for role, token_id in (("eod", self._model.eos_id()), ("pad", self._model.pad_id())):
            if token_id >= 0:
                self._special_ids[role] = token_id

    def tokenize(self, text: str) -> list[int]:
        return self._bos + self._model.encode(text)

    def detokenize(self, ids) -> str:
        return self._model.decode([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
    """A tokenizer saved with `save_pretrained` in a local directory (loaded offline)."""

    def __init__(self, directory: str):
        from transformers import AutoTokenizer

        self.name = f"HuggingFaceTokenizer({directory})"
        self._tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.vocab_size = len(self._tokenizer)
        t = self._tokenizer
        self._special_ids = {"eod": t.eos_token_id if t.eos_token_id is not None else t.sep_token_id,
                             "cls": t.cls_token_id, "sep": t.sep_token_id,
                             "mask": t.mask_token_id, "pad": t.pad_token_id}

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


class NullTokenizer(Tokenizer):
    """Text is already token ids, written as whitespace-separated integers in [0, vocab_size).

    As in Megatron-LM, the end-of-document id is appended after them: eod = vocab_size, so the
    true vocabulary is vocab_size + 1. No BERT special tokens exist.
    """

    def __init__(self, vocab_size: int):
        if vocab_size <= 0:
            raise ValueError(f"NullTokenizer needs --vocab-size N with N > 0, got {vocab_size}")
        self.name = "NullTokenizer"
        self.vocab_size = vocab_size + 1
        self._special_ids = {"eod": vocab_size, "cls": None, "sep": None, "mask": None, "pad": None}

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer expects whitespace-separated integers, got "
                             f"{text[:60]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} is outside [0, {self.vocab_size})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def tokenizer_files(kind: str | None) -> list[tuple[str, str]]:
    """(DataConfig field, flag) of each file or directory --tokenizer-type `kind` reads."""
    if kind == "GPT2BPETokenizer":
        return [("vocab_file", "--vocab-file"), ("merge_file", "--merge-file")]
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return [("vocab_file", "--vocab-file")]
    if kind in SENTENCEPIECE_TYPES or kind == "HuggingFaceTokenizer":
        return [("tokenizer_model", "--tokenizer-model")]
    return []


def _existing_file(flag: str, path: str | None, tokenizer_type: str, expected: str) -> str:
    if path is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag} ({expected})")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: file not found (expected {expected})")
    return path


def build_tokenizer(data: DataConfig, vocab_size: int = 0) -> Tokenizer:
    """The tokenizer chosen by --tokenizer-type; `vocab_size` is --vocab-size (NullTokenizer, mock).

    With --mock-data and no --tokenizer-type, a NullTokenizer whose whole vocabulary (eod included)
    is exactly --vocab-size stands in, so the model and the mock tokens agree.
    """
    kind = data.tokenizer_type
    if kind is None:
        if data.mock_data and vocab_size > 1:
            return NullTokenizer(vocab_size - 1)
        raise ValueError("--tokenizer-type is required (or --mock-data with --vocab-size)")
    if kind == "GPT2BPETokenizer":
        from tokenizers import ByteLevelBPETokenizer

        vocab = _existing_file("--vocab-file", data.vocab_file, kind, "a GPT-2 vocab.json")
        merges = _existing_file("--merge-file", data.merge_file, kind, "a GPT-2 merges.txt")
        return _RustTokenizer(kind, ByteLevelBPETokenizer(vocab, merges))
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        from tokenizers import BertWordPieceTokenizer

        vocab = _existing_file("--vocab-file", data.vocab_file, kind, "a WordPiece vocab.txt")
        lowercase = kind == "BertWordPieceLowerCase"
        return _RustTokenizer(kind, BertWordPieceTokenizer(vocab, lowercase=lowercase,
                                                           strip_accents=lowercase),
                              eod_fallback="sep")
    if kind in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(_existing_file("--tokenizer-model", data.tokenizer_model, kind,
                                                     "a SentencePiece .model file"), kind,
                                      prepend_bos=kind == "Llama2Tokenizer")
    if kind == "HuggingFaceTokenizer":
        directory = data.tokenizer_model
        if directory is None:
            raise ValueError(f"--tokenizer-type {kind} needs --tokenizer-model DIR (a local "
                             f"directory written by save_pretrained)")
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"--tokenizer-model {directory}: no such local directory "
                                    f"(HuggingFaceTokenizer loads offline; hub names are not fetched)")
        return HuggingFaceTokenizer(directory)
    if kind == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {kind} is not supported")
