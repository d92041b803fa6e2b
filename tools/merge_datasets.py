"""Concatenate Megatron indexed datasets into one.

    python tools/merge_datasets.py --input data/shards --output-prefix data/merged_text_document
    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \\
        --output-prefix data/ab

A directory contributes every PREFIX.bin/PREFIX.idx pair in it, in name order. All inputs must
share the token dtype (the same tokenizer). The output appears only once complete.
"""
from __future__ import annotations

import os
import sys

from tqdm import tqdm

from megatron_2bw.data.cli import ToolParser, exit_on_user_error
from megatron_2bw.data.indexed import IndexedDataset, IndexedDatasetBuilder, dataset_exists


def get_args(argv=None):
    parser = ToolParser(prog="merge_datasets.py", description=__doc__.split("\n")[0],
                        allow_abbrev=False)
    parser.add_argument("--input", nargs="+", required=True,
                        help="a directory of datasets, or dataset prefixes (in order)")
    parser.add_argument("--output-prefix", required=True)
    return parser.parse_args(argv)


def find_prefixes(inputs: list[str]) -> list[str]:
    prefixes = []
    for path in inputs:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, name[:-4]) for name in os.listdir(path)
                           if name.endswith(".idx") and dataset_exists(os.path.join(path, name[:-4])))
            if not found:
                raise ValueError(f"--input {path}: the directory holds no PREFIX.bin/PREFIX.idx pair")
            prefixes.extend(found)
        elif dataset_exists(path):
            prefixes.append(path)
        else:
            raise FileNotFoundError(f"--input {path}: neither a directory nor a dataset prefix "
                                    f"({path}.bin and {path}.idx)")
    return prefixes


def main(argv=None) -> str:
    args = get_args(argv)
    prefixes = find_prefixes(args.input)
    if os.path.abspath(args.output_prefix) in map(os.path.abspath, prefixes):
        raise ValueError(f"--output-prefix {args.output_prefix} is also an input")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetBuilder(args.output_prefix, dtype.type) as builder:
        for prefix in tqdm(prefixes, unit=" datasets", desc="merging"):
            builder.add_index(prefix)
        builder.finalize()
    merged = IndexedDataset(args.output_prefix)
    print(f"merged {len(prefixes)} datasets: {merged.num_documents:,} documents, "
          f"{merged.num_tokens:,} tokens -> {args.output_prefix}.{{bin,idx}}", flush=True)
    return args.output_prefix


if __name__ == "__main__":
    with exit_on_user_error(sys.argv[0]):
        main()
