"""Paired runs: pipeline training with receives posted ahead (the gloo default) against posted
with the exchange, on the planner validation's GPT.

    python benchmarks/p2p_receive_ahead.py --pipeline-stages 2 --pairs 12
    python benchmarks/p2p_receive_ahead.py --pipeline-stages 4 --pairs 10

Each pair runs both ways back to back (the order alternating), so the machine's drift over
minutes cancels in the ratio; the median ratio and its quartiles are printed.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from planner_validation import _train, model_config, on_ranks, slowest_rank  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline-stages", type=int, default=2)
    parser.add_argument("--pipeline-layer-split", default=None,
                        help="layers per stage, e.g. 3,1 (default: even)")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--schedule", default="2bw", choices=["2bw", "flush", "gpipe"])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--warmup-batches", type=int, default=2)
    parser.add_argument("--measured-batches", type=int, default=8)
    args = parser.parse_args(argv)
    if args.pipeline_stages < 2 or args.pairs < 1 or args.measured_batches < 1:
        parser.error("--pipeline-stages must be at least 2, --pairs and --measured-batches at least 1")
    if args.pipeline_layer_split is not None:
        try:
            split = [int(n) for n in args.pipeline_layer_split.split(",")]
        except ValueError:
            split = []
        if len(split) != args.pipeline_stages or sum(split) != 4 or min(split) < 1:
            parser.error(f"--pipeline-layer-split needs {args.pipeline_stages} positive layer counts "
                         f"summing to the GPT's 4 layers, got {args.pipeline_layer_split!r}")
        args.pipeline_layer_split = split
    for name, value in (("num_layers", 4), ("hidden_size", 128), ("num_attention_heads", 4),
                        ("seq_length", 128), ("vocab_size", 4096), ("global_batch_size", 16)):
        setattr(args, name, value)  # planner_validation's GPT
    return args


def main(argv=None) -> float:
    args = parse_args(argv)
    torch.set_num_threads(1)
    config = copy.deepcopy(model_config(args))
    config.parallel.pipeline_parallel, config.parallel.schedule = args.pipeline_stages, args.schedule
    if args.pipeline_layer_split:
        config.parallel.layer_split = args.pipeline_layer_split
    config.training.micro_batch_size = args.micro_batch_size
    ratios = []
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 else (False, True)
        ms = {ahead: 1000 * statistics.mean(slowest_rank(on_ranks(
            args.pipeline_stages, _train, config, args.warmup_batches, args.measured_batches, ahead)))
              for ahead in order}
        ratios.append(ms[True] / ms[False])
        print(f"pair {pair + 1}: posted with the exchange {ms[False]:.0f} ms/iteration, "
              f"ahead {ms[True]:.0f} ms ({ratios[-1]:.3f}x)", flush=True)
    low, middle, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    print(f"p={args.pipeline_stages} b={args.micro_batch_size} {args.schedule}: receives ahead take "
          f"{statistics.median(ratios):.3f}x the time per iteration (quartiles {low:.3f}-{high:.3f}, "
          f"{len(ratios)} pairs)")
    return statistics.median(ratios)


if __name__ == "__main__":
    main()
