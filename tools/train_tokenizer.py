"""Train a tokenizer on local text: SentencePiece (default) or GPT-2-style byte-level BPE.

    python tools/train_tokenizer.py --input data/shakespeare/train.jsonl \\
        --output-prefix data/shakespeare/spm --vocab-size 4096

writes PREFIX.model and PREFIX.vocab, for --tokenizer-type SentencePieceTokenizer
--tokenizer-model PREFIX.model. The model carries every special token the datasets need:
<unk>=0, <s>=1, </s>=2 (eod), <pad>=3, and the control symbols [CLS] [SEP] [MASK] (BERT).
With --byte-level-bpe it writes PREFIX-vocab.json and PREFIX-merges.txt instead (ending token
<|endoftext|>), for --tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ....
"""
from __future__ import annotations

import os
import sys
from typing import Iterator

from tqdm import tqdm

from megatron_2bw.data.cli import ToolParser, exit_on_user_error
from megatron_2bw.data.documents import find_sources, iter_documents

BERT_CONTROL_SYMBOLS = ["[CLS]", "[SEP]", "[MASK]"]
GPT_END_OF_TEXT = "<|endoftext|>"


def get_args(argv=None):
    parser = ToolParser(prog="train_tokenizer.py", description=__doc__.split("\n")[0],
                        allow_abbrev=False)
    parser.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl/... files or directories")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                        help="SentencePiece model type")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--byte-level-bpe", action="store_true",
                        help="GPT-2-style vocab.json/merges.txt with the tokenizers library")
    parser.add_argument("--max-sentences", type=int, default=2_000_000,
                        help="SentencePiece trains on a random sample of at most this many lines")
    args = parser.parse_args(argv)
    if args.vocab_size < 2:
        parser.error(f"--vocab-size must be >= 2, got {args.vocab_size}")
    return args


def iter_lines(inputs: list[str], keys: list[str]) -> Iterator[str]:
    """Non-empty lines of every document: trainers want sentence-sized pieces, not whole books."""
    for texts in tqdm(iter_documents(find_sources(inputs), keys), unit=" docs", desc="reading"):
        for key in keys:
            for line in texts[key].splitlines():
                if line.strip():
                    yield line


def train_sentencepiece(args) -> list[str]:
    import sentencepiece

    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter_lines(args.input, args.json_keys),
            model_prefix=args.output_prefix, vocab_size=args.vocab_size,
            model_type=args.model_type, character_coverage=1.0,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, control_symbols=BERT_CONTROL_SYMBOLS,
            input_sentence_size=args.max_sentences, shuffle_input_sentence=True,
            minloglevel=2)
    except RuntimeError as error:  # e.g. "Vocabulary size too high": name our flag
        reason = str(error).strip().splitlines()[-1].rsplit("] ", 1)[-1]  # drop the C++ location
        raise ValueError(f"SentencePiece could not train with --vocab-size {args.vocab_size} on "
                         f"this input: {reason}") from None
    return [args.output_prefix + ".model", args.output_prefix + ".vocab"]


def train_byte_level_bpe(args) -> list[str]:
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(iter_lines(args.input, args.json_keys), vocab_size=args.vocab_size,
                                  special_tokens=[GPT_END_OF_TEXT], show_progress=False)
    directory, name = os.path.split(os.path.abspath(args.output_prefix))
    return tokenizer.save_model(directory, name)


def main(argv=None) -> list[str]:
    args = get_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    written = train_byte_level_bpe(args) if args.byte_level_bpe else train_sentencepiece(args)
    print("wrote " + ", ".join(written), flush=True)
    return written


if __name__ == "__main__":
    with exit_on_user_error(sys.argv[0]):
        main()
