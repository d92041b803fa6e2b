"""Zero-shot evaluation of a GPT checkpoint: token-level perplexity or LAMBADA accuracy.

    # perplexity over a preprocessed dataset (documents concatenated in index order)
    python tools/evaluate_perplexity.py --load checkpoints/gpt --data-path data/wiki_text_document
    # WikiText-103 protocol of Megatron-LM: raw text, overlapping windows of stride 256
    python tools/evaluate_perplexity.py --load checkpoints/gpt --input wiki.test.tokens \\
        --overlapping-eval 256 --tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...
    # LAMBADA last-word accuracy (JSON lines with a "text" field)
    python tools/evaluate_perplexity.py --load checkpoints/gpt --task lambada \\
        --input lambada_test.jsonl --strict-lambada
    # tensor parallel (and data parallel over the remaining ranks)
    torchrun --nproc-per-node 2 tools/evaluate_perplexity.py --tensor-model-parallel-size 2 ...

Windows are --seq-length tokens (default: the checkpoint's). Any checkpoint layout loads: the
weights are resharded in memory for this run's --tensor-model-parallel-size (pipeline size 1).
Model and tokenizer flags left unset come from the checkpoint. Prints the figures and, with
--output FILE, writes them as JSON.
"""
from __future__ import annotations

import json
import os
import sys


import numpy as np
import torch
import torch.distributed as dist

from megatron_2bw.arguments import ConfigError, build_parser
from megatron_2bw.checkpoint.reshard import load_full_weights, read_full_state
from megatron_2bw.checkpoint.tool_config import config_with_base
from megatron_2bw.cpu_threads import set_single_process_threads
from megatron_2bw.data.cli import exit_on_user_error
from megatron_2bw.data.indexed import IndexedDataset
from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.distributed.launch import detect_launch, exit_process, init_distributed
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.evaluation import perplexity as P
from megatron_2bw.models import build_stage_model


def add_arguments(parser) -> None:
    group = parser.add_argument_group("evaluation")
    group.add_argument("--task", choices=["perplexity", "lambada"], default="perplexity")
    group.add_argument("--input", type=str, default=None,
                       help="raw text file (perplexity) or LAMBADA JSON lines, read with the "
                            "tokenizer flags; instead of --data-path")
    group.add_argument("--overlapping-eval", type=int, default=None, metavar="K",
                       help="sliding windows of stride K counting their last K targets "
                            "(Megatron-LM's WikiText-103 protocol)")
    group.add_argument("--strict-lambada", action="store_true",
                       help="LAMBADA target = the whole last word, not its last token")
    group.add_argument("--output", type=str, default=None, help="write the figures as JSON")
    group.add_argument("--iteration", type=int, default=None,
                       help="checkpoint iteration (default: the latest)")


def matching_tokenizer(config, model_vocab: int, required: bool):
    """The tokenizer of the flags (or the checkpoint's), which must cover the model's vocabulary
    exactly; None if none is configured and the data is already token ids."""
    try:
        tokenizer = build_tokenizer(config.data, config.model.vocab_size)
    except (ValueError, FileNotFoundError):
        if required:
            raise
        return None
    if tokenizer.vocab_size != model_vocab:
        raise ConfigError(f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} ids, the "
                          f"checkpoint's model {model_vocab}: give the tokenizer flags of training")
    return tokenizer


def read_tokens(args, tokenizer) -> tuple[np.ndarray, float | None]:
    """The evaluated token stream and, for raw text, tokens per original word (Megatron's count
    of space-separated words, for the adjusted perplexity)."""
    if args.input is not None:
        if not os.path.isfile(args.input):
            raise FileNotFoundError(f"--input {args.input}: file not found")
        text = open(args.input, encoding="utf-8").read()
        tokens = np.asarray(tokenizer.tokenize(text), dtype=np.int64)
        words = len(text.strip().split(" "))
        return tokens, (len(tokens) - 1) / max(words - 1, 1)
    if len(args.data_path) != 1:
        raise ConfigError(f"--data-path takes one dataset prefix here, got {len(args.data_path)} "
                          f"values")
    dataset = IndexedDataset(args.data_path[0])
    return np.concatenate([dataset[i] for i in range(len(dataset))]).astype(np.int64), None


def read_lambada(path: str, tokenizer, strict: bool) -> list[tuple[list[int], list[int]]]:
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"--task lambada needs --input FILE (JSON lines with a \"text\" "
                                f"field); got {path}")
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: expected a JSON object with a \"text\" "
                                 f"field") from None
            examples.append(P.lambada_example(text, tokenizer, strict))
    return examples


def build_model(config, state, launch):
    """This rank's whole-model GPT (p = 1) for its tensor-parallel slice, filled from `state`."""
    device, t = torch.device("cpu"), config.parallel.tensor_parallel
    if launch.world_size > 1:
        launch, device = init_distributed(config.parallel.distributed_backend,
                                          config.parallel.timeout_minutes)
    if launch.world_size % t:
        raise ConfigError(f"world size {launch.world_size} is not divisible by "
                          f"--tensor-model-parallel-size {t}")
    layout = ParallelLayout(launch.world_size, t, 1, launch.rank)
    if launch.world_size > 1:
        layout.build_groups(config.parallel.timeout_minutes)
    model = build_stage_model(config.model, layout.group("tensor"), t,
                              range(config.model.num_layers), True, True, config.training.seed)
    load_full_weights(model, state)
    return model.to(device), layout, device


def main(argv=None) -> dict:
    args = build_parser(__doc__.split("\n")[0], add_arguments).parse_args(argv)
    if not args.load:
        raise ConfigError("--load CHECKPOINT_DIR is required")
    if args.task == "perplexity" and (args.input is None) == (args.data_path is None):
        raise ConfigError("give exactly one of --data-path PREFIX and --input FILE")
    launch = detect_launch()
    if launch.world_size == 1:
        set_single_process_threads()
    state = read_full_state(args.load, args.iteration, with_optimizer=False,
                            show_progress=launch.rank == 0)
    config = config_with_base(args, state.config, f"checkpoint {args.load}", checkpoint=args.load)
    if config.model.model_type != "gpt":
        raise ConfigError(f"checkpoint {args.load} holds a {config.model.model_type} model; "
                          f"perplexity evaluation needs a GPT")
    for flag, size in [("--pipeline-model-parallel-size", config.parallel.pipeline_parallel),
                       ("--context-parallel-size", config.parallel.context_parallel)]:
        if size != 1:
            raise ConfigError(f"{flag} must be 1 for evaluation (any checkpoint layout loads; "
                              f"use tensor parallelism to split the model)")
    seq_length = config.model.seq_length
    tokenizer = matching_tokenizer(config, state.config.model.vocab_size,
                                   required=args.task == "lambada" or args.input is not None)
    config.model.vocab_size = state.config.model.vocab_size  # --vocab-size sized the tokenizer

    owns_process_group = launch.world_size > 1 and not dist.is_initialized()
    model, layout, device = build_model(config, state, launch)

    pad_id = tokenizer.eod if tokenizer is not None and tokenizer.has("eod") else 0  # masked
    if args.task == "lambada":
        examples = read_lambada(args.input, tokenizer, args.strict_lambada)
        windows, truncated = P.lambada_windows(examples, seq_length, pad_id)
    else:
        tokens, tokens_per_word = read_tokens(args, tokenizer)
        windows = (P.full_windows(tokens, seq_length) if args.overlapping_eval is None
                   else P.overlapping_windows(tokens, seq_length, args.overlapping_eval, pad_id))
        if not windows:
            raise ValueError(f"the evaluation data has {len(tokens)} tokens: not enough for one "
                             f"window of --seq-length {seq_length} (+1)")
    totals = P.score_windows(model, windows, config.training.micro_batch_size, device,
                             layout.coords.dp, layout.data, layout.group("data"),
                             with_predictions=args.task == "lambada",
                             show_progress=layout.rank == 0)
    if args.task == "lambada":
        report = P.lambada_report(totals, args.strict_lambada, truncated)
    else:
        report = P.perplexity_report(totals, seq_length, args.overlapping_eval, tokens_per_word)
    report.update(checkpoint=args.load, iteration=state.iteration)
    if layout.rank == 0:
        print(" " + " | ".join(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}"
                               for k, v in report.items()), flush=True)
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(report, f, indent=2)
    if owns_process_group:
        dist.barrier()  # no rank closes its connections while another still communicates
        dist.destroy_process_group()
    return report


if __name__ == "__main__":
    with exit_on_user_error(sys.argv[0]):
        main()
    exit_process(0)
