"""Exposed data-parallel communication per batch at d = 2, with and without overlapping it.

    python benchmarks/exposed_communication.py --json docs/exposed_communication.json

Exposed communication is the time a rank's host spends in the data-parallel gradient reduction
and waiting for it (the runtime's `allreduce` timer: reduce(b) and the waits before the next
backward or the step), plus, with the distributed optimizer, the time it waits for the new
weight version's all-gather. For each schedule (2BW, Flush) and each way of averaging (all-reduce;
the distributed optimizer's reduce-scatter and all-gather) two configurations run:

- **after the backward**: `--no-overlap-grad-reduce`; with the distributed optimizer the new
  version's all-gather is waited for in the step that starts it and the gradient norm's shard
  sums are added over the replicas first, in a blocking all-reduce (the synchronous path);
- **overlapped**: `--overlap-grad-reduce` (buckets start during the batch's last backward), the
  all-gather in the background, waited for region by region in the next forward, the norm in
  one background all-reduce.

All configurations are built once on the same ranks and run in turn, a few batches each, round
after round, so that drift of the machine affects them alike; the result is the median and the
spread (min, max) over rounds and ranks of the milliseconds per batch. On a CPU with gloo the
collectives run on the same cores as the compute, so overlapping can only hide what the cores
have to spare; on GPUs NCCL runs beside the compute.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from megatron_2bw.config import (Config, ModelConfig, OptimizerConfig,  # noqa: E402
                                 ParallelConfig, TrainingConfig)
from megatron_2bw.data.mock import MockGPTDataset  # noqa: E402
from megatron_2bw.distributed.forked import run_forked  # noqa: E402
from megatron_2bw.distributed.layout import ParallelLayout  # noqa: E402
from megatron_2bw.logging import Timers  # noqa: E402
from megatron_2bw.pipeline import param_gather  # noqa: E402
from megatron_2bw.training.segments import run_segment  # noqa: E402
from megatron_2bw.training.stage import build_stage  # noqa: E402

SCHEDULES = ("2bw", "flush")
AVERAGING = ("all-reduce", "distributed-optimizer")
MODES = ("after-backward", "overlapped")


def _config(args, schedule: str, sharded: bool, overlapped: bool) -> Config:
    return Config(
        model=ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                          num_attention_heads=args.hidden // 64, seq_length=args.seq_length,
                          vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(pipeline_parallel=1, schedule=schedule,
                                use_distributed_optimizer=sharded,
                                ddp_bucket_size=args.bucket_elements,
                                overlap_grad_reduce=overlapped),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-4, lr_decay_style="constant"),
        training=TrainingConfig(micro_batch_size=args.micro_batch_size,
                                global_batch_size=args.micro_batch_size * args.microbatches * 2,
                                train_iters=10 ** 6, seed=1234))


class _GatherClock:
    """Seconds this rank waits for new versions' all-gathers; in the after-backward mode it
    waits for each in the step that starts it."""

    def __init__(self):
        self.seconds = 0.0
        self.in_step = False
        add, wait = param_gather.ParameterGathers.add, param_gather.ParameterGathers.wait
        clock = self

        def timed_wait(gathers, copy, through=None):
            start = time.perf_counter()
            wait(gathers, copy, through)
            clock.seconds += time.perf_counter() - start

        def add_maybe_waiting(gathers, copy, region, work, source):
            add(gathers, copy, region, work, source)
            if clock.in_step:
                timed_wait(gathers, copy)

        param_gather.ParameterGathers.add = add_maybe_waiting  # this forked rank's class
        param_gather.ParameterGathers.wait = timed_wait


def _measure(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)  # two ranks on the machine's cores
    layout = ParallelLayout(world, 1, 1, rank, 1)
    layout.build_groups(10.0)
    clock = _GatherClock()
    dataset = MockGPTDataset(100_000, args.seq_length, args.vocab, 7)
    stages = {}
    for schedule in args.schedules:
        for averaging in AVERAGING:
            for mode in MODES:
                sharded, overlapped = averaging == AVERAGING[1], mode == MODES[1]
                config = _config(args, schedule, sharded, overlapped)
                stage = build_stage(config, layout, torch.device("cpu"), Timers(1))
                if sharded and not overlapped:
                    stage.updater.sharded_norm_group = None  # the blocking two-step sum
                stages[schedule, averaging, mode] = stage

    def feed(k: int) -> dict:
        start = (k * world + rank) * args.micro_batch_size
        samples = [dataset[i] for i in range(start, start + args.micro_batch_size)]
        return {key: torch.stack([torch.from_numpy(s[key]) for s in samples])
                for key in samples[0]}

    figures = {key: {"exposed": [], "allreduce": [], "gather": [], "batch": []} for key in stages}
    done = {key: 0 for key in stages}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for key, stage in stages.items():
            clock.seconds, clock.in_step = 0.0, key[2] == MODES[0]
            stage.timers.summary(reset=True)
            start = time.perf_counter()
            run_segment(stage, done[key], args.batches, feed)
            elapsed = time.perf_counter() - start
            done[key] += args.batches
            allreduce = stage.timers.summary().get("allreduce", 0.0)
            if round_ == 0:
                continue
            per_batch = {"allreduce": allreduce, "gather": clock.seconds,
                         "exposed": allreduce + clock.seconds, "batch": elapsed}
            for name, seconds in per_batch.items():
                figures[key][name].append(seconds * 1e3 / args.batches)
    return {"|".join(key): value for key, value in figures.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4, help="per batch and replica")
    parser.add_argument("--bucket-elements", type=int, default=1_000_000,
                        help="--ddp-bucket-size")
    parser.add_argument("--batches", type=int, default=3, help="per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if min(args.layers, args.micro_batch_size, args.microbatches, args.batches, args.rounds,
           args.bucket_elements) < 1 or args.hidden % 64:
        parser.error("sizes and counts must be positive; --hidden a multiple of 64")
    per_rank = run_forked(2, _measure, args, timeout=1800.0)
    rows = []
    print(f"d = 2, p = 1, {args.rounds} rounds of {args.batches} batches per configuration; "
          f"ms per batch, median [min, max] over rounds and ranks")
    print(f"{'schedule':<9} {'averaging':<22} {'mode':<15} {'exposed':>22} {'batch':>22}")
    for key in per_rank[0]:
        schedule, averaging, mode = key.split("|")
        row = {"schedule": schedule, "averaging": averaging, "mode": mode}
        for name in ("exposed", "allreduce", "gather", "batch"):
            values = [v for rank in per_rank for v in rank[key][name]]
            row[name + "_ms"] = {"median": statistics.median(values), "min": min(values),
                                 "max": max(values)}
        rows.append(row)
        print(f"{schedule:<9} {averaging:<22} {mode:<15} {_spread(row['exposed_ms']):>22} "
              f"{_spread(row['batch_ms']):>22}", flush=True)
    result = {"setup": {**vars(args), "json": None, "data_parallel": 2, "backend": "gloo",
                        "device": "cpu"}, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _spread(figure: dict) -> str:
    return f"{figure['median']:.1f} [{figure['min']:.1f}, {figure['max']:.1f}]"


if __name__ == "__main__":
    main()
