"""Per-stage recomputation against uniform recomputation under one memory budget, measured.

    python benchmarks/stage_recompute.py        # writes docs/stage_recompute.json

Two gloo ranks train an 8-layer GPT at p = 2 (2BW, split 4,4, m = 4). The memory budget is set
between what stage 0 needs with and without recomputing its layers (the planner's estimator,
planner/memory.py): under 1F1B stage 0 holds p microbatches' activations and stage 1 one, so
stage 0 must recompute some layers and stage 1 need not. The planner (planner/stage_plan.py,
split pinned) chooses each stage's fewest recomputed layers under the budget; it is run against
the uniform plans that also fit (every stage recomputing stage 0's count, and full recomputation
of every layer) and against no recomputation (which does not fit), each a copy of the model
built once, segment after segment in rotating order so that the machine's drift falls on all
alike. Reported: samples/s (median and range over the segments, and each plan against the
planner's round by round), each stage's estimated peak against the budget, and each stage's
measured activation peak (memory.py's tracker).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.repartition import feed_for  # noqa: E402
from megatron_2bw.config import (Config, ModelConfig, OptimizerConfig, ParallelConfig,  # noqa: E402
                                 PrecisionConfig, RecomputeConfig, TrainingConfig)
from megatron_2bw.distributed.forked import run_forked  # noqa: E402
from megatron_2bw.distributed.layout import ParallelLayout  # noqa: E402
from megatron_2bw.planner.memory import estimate_stage_memory  # noqa: E402
from megatron_2bw.planner.stage_plan import LayerCosts, memory_bound, plan_stages  # noqa: E402
from megatron_2bw.training.segments import run_segment  # noqa: E402
from megatron_2bw.training.stage import build_stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYERS, STAGES, SPLIT = 8, 2, (4, 4)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--segment-iterations", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=str(ROOT / "docs" / "stage_recompute.json"))
    return parser.parse_args(argv)


def bench_config(args, plan: tuple[int, ...] | None) -> Config:
    model = ModelConfig(num_layers=LAYERS, hidden_size=args.hidden_size, num_attention_heads=4,
                        seq_length=args.seq_length, vocab_size=256, hidden_dropout=0.0,
                        attention_dropout=0.0)
    micro = args.micro_batch_size
    return Config(model=model,
                  parallel=ParallelConfig(pipeline_parallel=STAGES, schedule="2bw",
                                          layer_split=list(SPLIT)),
                  recompute=RecomputeConfig(num_layers_per_stage=list(plan) if plan else None),
                  optimizer=OptimizerConfig(lr=1e-4, lr_decay_style="constant"),
                  training=TrainingConfig(micro_batch_size=micro, global_batch_size=4 * micro,
                                          seed=1234))


def estimates(config: Config) -> list[float]:
    """Each stage's estimated peak bytes (the planner's estimator)."""
    c = config
    return [estimate_stage_memory(c.model, c.parallel, PrecisionConfig(), c.recompute, "adam",
                                  c.training.micro_batch_size, 4, 1, s).total
            for s in range(STAGES)]


def plans(args) -> tuple[float, dict[str, tuple[int, ...] | None]]:
    """The budget and the plans to run: the planner's, the uniform ones that fit, none."""
    base = bench_config(args, None)
    none, all_recomputed = estimates(base)[0], estimates(bench_config(args, SPLIT))[0]
    budget = (none + all_recomputed) / 2
    fewest = memory_bound(base.model, base.parallel, PrecisionConfig(), "adam",
                          args.micro_batch_size, 4, 1, budget, pinned_split=SPLIT)
    # equal layers: forward 1, backward 2, a recomputation 1 more (the planner's own ratios)
    chosen = plan_stages(LayerCosts.uniform(LAYERS, 1.0, 2.0, 1.0), STAGES, fewest)
    stage0 = chosen.recompute[0]
    return budget, {"planner": tuple(chosen.recompute),
                    "uniform": (stage0,) * STAGES,
                    "full": SPLIT,
                    "none": None}


def worker(rank: int, world: int, args, to_run: dict) -> dict:
    layout = ParallelLayout(world, 1, STAGES, rank)
    layout.build_groups(5.0)
    copies = {name: build_stage(bench_config(args, plan), layout, torch.device("cpu"), None)
              for name, plan in to_run.items()}
    feeds = {name: feed_for(stage.config) for name, stage in copies.items()}
    samples = copies["planner"].config.training.global_batch_size
    for name, stage in copies.items():  # a warm-up segment each
        run_segment(stage, 0, 1, feeds[name])
        stage.iteration = 1
    segments = []
    names = list(copies)
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            stage = copies[name]
            dist.barrier()
            start = time.perf_counter()
            run_segment(stage, stage.iteration, args.segment_iterations, feeds[name])
            dist.barrier()
            seconds = time.perf_counter() - start
            stage.iteration += args.segment_iterations
            segments.append({"round": round_, "plan": name,
                             "samples_per_s": samples * args.segment_iterations / seconds})
    peaks = {name: stage.memory.peak_activation_bytes for name, stage in copies.items()}
    return {"segments": segments, "activation_peak": peaks}


def summarize(results: list[dict], budget: float, to_run: dict, args) -> dict:
    segments = results[0]["segments"]
    by_plan = {}
    planner_by_round = {s["round"]: s["samples_per_s"] for s in segments if s["plan"] == "planner"}
    for name, plan in to_run.items():
        rates = [s["samples_per_s"] for s in segments if s["plan"] == name]
        paired = [s["samples_per_s"] / planner_by_round[s["round"]]
                  for s in segments if s["plan"] == name]
        estimate = estimates(bench_config(args, plan))
        by_plan[name] = {
            "recompute": list(plan) if plan else [0] * STAGES,
            "samples_per_s": {"median": statistics.median(rates), "min": min(rates),
                              "max": max(rates)},
            "vs_planner_by_round": {"median": statistics.median(paired), "min": min(paired),
                                    "max": max(paired)},
            "estimated_peak_mib": [e / 2**20 for e in estimate],
            "fits_budget": all(e <= budget for e in estimate),
            "measured_activation_peak_mib": [r["activation_peak"][name] / 2**20
                                             for r in results],
        }
    return {"setup": {"layers": LAYERS, "stages": STAGES, "split": list(SPLIT),
                      "hidden_size": args.hidden_size, "seq_length": args.seq_length,
                      "micro_batch_size": args.micro_batch_size, "microbatches": 4,
                      "schedule": "2bw", "precision": "fp32", "optimizer": "adam",
                      "segment_iterations": args.segment_iterations, "rounds": args.rounds},
            "budget_mib": budget / 2**20, "plans": by_plan, "segments": segments}


def main(argv=None) -> dict:
    args = parse_args(argv)
    budget, to_run = plans(args)
    results = run_forked(STAGES, worker, args, to_run, timeout=1800.0)
    summary = summarize(results, budget, to_run, args)
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"budget {summary['budget_mib']:.1f} MiB per stage (estimated)")
    for name, row in summary["plans"].items():
        rate, paired = row["samples_per_s"], row["vs_planner_by_round"]
        print(f"{name:8s} recompute {','.join(map(str, row['recompute']))}: "
              f"{rate['median']:.2f} samples/s ({rate['min']:.2f}-{rate['max']:.2f}), "
              f"{100 * paired['median']:.1f}% of the planner's by round "
              f"({100 * paired['min']:.1f}-{100 * paired['max']:.1f}%); estimated peak "
              f"{', '.join(f'{m:.1f}' for m in row['estimated_peak_mib'])} MiB "
              f"({'fits' if row['fits_budget'] else 'does not fit'}); measured activations "
              f"{', '.join(f'{m:.1f}' for m in row['measured_activation_peak_mib'])} MiB")
    return summary


if __name__ == "__main__":
    main()
