"""Online repartitioning against the best static split, in one run on this machine.

    python benchmarks/repartition.py            # writes docs/repartition.json and the picture

Two gloo ranks train a 4-layer GPT at p = 2 (2BW) in several copies side by side, segment after
segment in rotating order so that the machine's drift falls on all of them alike: one copy per
static split (1,3; 2,2; 3,1), the balanced split once more run undrained for twice as long per
segment (what draining every segment costs), and the repartitioned run, which starts from the bad
split 3,1. The repartitioned run measures its layers (pipeline/layer_times.py) and moves layers
with the runtime's own code (pipeline/repartition.Repartitioner) after its second segment.

Every layer's forward also waits --layer-wait-ms and its backward twice that: on a machine whose
processors are shared with other work, compute times alone vary from segment to segment by more
than the differences between splits; a wait is a cost of known size that the ranks do not compete
for (0 leaves the layers' compute alone). Phase 2 makes layers 0 and 1 heavier from then on
(vPipe's architecture-search case): each of their forwards waits --heavy-ms more and each backward
twice that. The static copies keep their splits; the repartitioned run measures again and moves
again after the phase's second segment.

Reported per phase: samples/s of each copy (median over its segments and their range), the
repartitioned run before and after its move against the best static split (as medians over the
phase, and round by round: each segment after the move against the best split's segment of the
same round), the time of the move
(and the layers it moved) against one iteration, and the drain's cost.
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

from megatron_2bw.config import (Config, ModelConfig, OptimizerConfig, ParallelConfig,  # noqa: E402
                                 TrainingConfig)
from megatron_2bw.data.mock import MockGPTDataset  # noqa: E402
from megatron_2bw.distributed.forked import run_forked  # noqa: E402
from megatron_2bw.distributed.layout import ParallelLayout  # noqa: E402
from megatron_2bw.pipeline.repartition import Repartitioner, stage_split  # noqa: E402
from megatron_2bw.training.segments import run_segment  # noqa: E402
from megatron_2bw.training.stage import build_stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STATIC = ("1,3", "2,2", "3,1")
UNDRAINED = "2,2 undrained"
DYNAMIC = "repartitioned"
HEAVY_LAYERS = (0, 1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segment-iterations", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6, help="segments per copy and phase")
    parser.add_argument("--move-after", type=int, default=2,
                        help="the repartitioned run decides after this many segments per phase")
    parser.add_argument("--layer-wait-ms", type=float, default=10.0)
    parser.add_argument("--heavy-ms", type=float, default=20.0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--json", default=str(ROOT / "docs" / "repartition.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "images" / "repartition.png"))
    return parser.parse_args(argv)


def bench_config(args, split: str) -> Config:
    model = ModelConfig(num_layers=4, hidden_size=args.hidden_size, num_attention_heads=4,
                        seq_length=128, vocab_size=256, hidden_dropout=0.0,
                        attention_dropout=0.0)
    return Config(model=model,
                  parallel=ParallelConfig(pipeline_parallel=2, schedule="2bw",
                                          layer_split=[int(x) for x in split.split(",")],
                                          repartition_interval=1),
                  optimizer=OptimizerConfig(lr=1e-4, lr_decay_style="constant"),
                  training=TrainingConfig(micro_batch_size=2, global_batch_size=8, seed=1234))


class _Wait(torch.autograd.Function):
    """Identity that waits `seconds` in forward and twice that in backward: a layer that costs
    more, inside the span layer_times.py measures."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class LayerWaits:
    """Every layer waits `base` seconds in each forward and twice that in each backward; layers
    HEAVY_LAYERS `heavy` more while `heavy_on` (hooks re-installed on every rebuilt stage)."""

    def __init__(self, base: float, heavy: float):
        self.base, self.heavy, self.heavy_on = base, heavy, False

    def install(self, stage) -> None:
        for name, layer in stage.model.transformer.layers.items():
            layer.register_forward_hook(self._forward(int(name)))

    def _forward(self, layer: int):
        def hook(module, args, output):
            if torch._C._current_graph_task_id() != -1:  # not again in recomputation
                return None
            seconds = self.base + (self.heavy if self.heavy_on and layer in HEAVY_LAYERS else 0)
            return _Wait.apply(output, seconds) if seconds else None
        return hook


def feed_for(config: Config):
    m = config.model
    data = MockGPTDataset(100_000, m.seq_length, m.vocab_size, 7)
    micro = config.training.micro_batch_size

    def feed(k: int) -> dict:
        samples = [data[i] for i in range(k * micro, (k + 1) * micro)]
        return {key: torch.stack([torch.from_numpy(s[key]) for s in samples])
                for key in samples[0]}
    return feed


def worker(rank: int, world: int, args) -> dict:
    layout = ParallelLayout(world, 1, 2, rank)
    layout.build_groups(5.0)
    heavy = LayerWaits(args.layer_wait_ms / 1000, args.heavy_ms / 1000)

    def build(config):
        stage = build_stage(config, layout, torch.device("cpu"), None)
        heavy.install(stage)
        return stage

    copies = {name: build(bench_config(args, name)) for name in STATIC}
    copies[UNDRAINED] = build(bench_config(args, "2,2"))
    copies[DYNAMIC] = build(bench_config(args, "3,1"))
    feeds = {name: feed_for(stage.config) for name, stage in copies.items()}
    lines: list[str] = []
    repartitioner = Repartitioner(copies[DYNAMIC].config, lines.append)
    repartitioner.attach(copies[DYNAMIC])
    samples_per_iteration = copies[DYNAMIC].config.training.global_batch_size
    segments, moves = [], []
    for phase in (1, 2):
        heavy.heavy_on = phase == 2
        repartitioner.times.reset()  # measure the model as it is now
        names = [*STATIC, DYNAMIC] + ([UNDRAINED] if phase == 1 else [])
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:  # rotating order
                stage = copies[name]
                iterations = args.segment_iterations * (2 if name == UNDRAINED else 1)
                dist.barrier()
                start = time.perf_counter()
                run_segment(stage, stage.iteration, iterations, feeds[name])
                dist.barrier()
                seconds = time.perf_counter() - start
                stage.iteration += iterations
                segments.append({"phase": phase, "round": round_, "copy": name,
                                 "split": ",".join(map(str, stage_split(stage.config))),
                                 "samples_per_s": samples_per_iteration * iterations / seconds,
                                 "seconds_per_iteration": seconds / iterations})
                if name == DYNAMIC and round_ == args.move_after - 1:
                    before = stage_split(stage.config)
                    copies[DYNAMIC] = repartitioner(stage, build)
                    decision, moved_s = repartitioner.decisions[-1]
                    after = stage_split(copies[DYNAMIC].config)
                    moves.append({"phase": phase, "after_round": round_, "line": lines[-1],
                                  "from": before, "to": after, "seconds": moved_s,
                                  "layers_moved": sum(abs(a - b) for a, b in
                                                      zip(before, after)) // 2,
                                  "predicted_gain": decision.gain})
    return {"segments": segments, "moves": moves} if rank == 0 else {}


def summarize(result: dict, args) -> dict:
    segments, moves = result["segments"], result["moves"]
    phases = {}
    for phase in (1, 2):
        rows = [s for s in segments if s["phase"] == phase]

        def stats(rows_of):
            values = [r["samples_per_s"] for r in rows_of]
            return {"median": statistics.median(values), "min": min(values),
                    "max": max(values), "segments": len(values)} if values else None
        copies = {name: stats([r for r in rows if r["copy"] == name])
                  for name in (*STATIC, UNDRAINED) if any(r["copy"] == name for r in rows)}
        best = max(STATIC, key=lambda name: copies[name]["median"])
        dynamic = [r for r in rows if r["copy"] == DYNAMIC]
        before = stats(dynamic[:args.move_after])
        after = stats(dynamic[args.move_after + 1:])  # the first segment after a move warms up
        # the same round's segments ran minutes apart at most: their ratio cancels the drift
        # that the medians over the whole phase keep
        best_by_round = {r["round"]: r["samples_per_s"] for r in rows if r["copy"] == best}
        paired = [r["samples_per_s"] / best_by_round[r["round"]]
                  for r in dynamic[args.move_after + 1:]]
        move = next(m for m in moves if m["phase"] == phase)
        iteration_s = statistics.median(r["seconds_per_iteration"] for r in rows
                                        if r["copy"] == best)
        phases[phase] = {
            "static": copies, "best_static_split": best,
            "repartitioned_before": before, "repartitioned_after": after,
            "after_vs_best": after["median"] / copies[best]["median"],
            "before_vs_best": before["median"] / copies[best]["median"],
            "after_vs_best_by_round": {"median": statistics.median(paired), "min": min(paired),
                                       "max": max(paired), "rounds": len(paired)},
            "move": move, "iteration_s_at_best_split": iteration_s,
            "move_vs_iteration": (move["seconds"] / iteration_s) if move["seconds"] else None}
        if UNDRAINED in copies:
            phases[phase]["drained_every_segment_vs_undrained"] = \
                copies["2,2"]["median"] / copies[UNDRAINED]["median"]
    return {"setup": {"segment_iterations": args.segment_iterations, "rounds": args.rounds,
                      "move_after": args.move_after, "heavy_ms": args.heavy_ms,
                      "layer_wait_ms": args.layer_wait_ms,
                      "hidden_size": args.hidden_size, "layers": 4, "stages": 2,
                      "schedule": "2bw", "global_batch": 8, "micro_batch": 2,
                      "heavy_layers": list(HEAVY_LAYERS)},
            "phases": phases, "segments": segments}


def plot(summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [*STATIC, UNDRAINED, DYNAMIC]
    for name in names:
        rows = [(i, s) for i, s in enumerate(summary["segments"]) if s["copy"] == name]
        style = dict(linewidth=2.5, color="black") if name == DYNAMIC else dict(alpha=0.7)
        ax.plot([i for i, _ in rows], [s["samples_per_s"] for _, s in rows], marker="o",
                markersize=3, label=name, **style)
    for i, s in enumerate(summary["segments"]):
        if s["phase"] == 2:
            ax.axvline(i - 0.5, color="grey", linestyle="--")
            ax.text(i, ax.get_ylim()[1] * 0.98, " layers 0, 1 heavier", va="top", fontsize=8)
            break
    ax.set_xlabel("segment (in the order run)")
    ax.set_ylabel("samples/s")
    ax.set_title("Repartitioning from split 3,1 against every static split (p=2, 2BW)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run_forked(2, worker, args, timeout=1800.0)[0]
    summary = summarize(result, args)
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, args.plot)
    for phase, figures in summary["phases"].items():
        move = figures["move"]
        print(f"phase {phase}: best static split {figures['best_static_split']} "
              f"{figures['static'][figures['best_static_split']]['median']:.2f} samples/s; "
              f"repartitioned {figures['repartitioned_before']['median']:.2f} before "
              f"({100 * figures['before_vs_best']:.1f}% of best), "
              f"{figures['repartitioned_after']['median']:.2f} after "
              f"({100 * figures['after_vs_best']:.1f}% of best)")
        by_round = figures["after_vs_best_by_round"]
        print(f"  after the move against the best split in the same round: median "
              f"{100 * by_round['median']:.1f}% ({100 * by_round['min']:.1f}-"
              f"{100 * by_round['max']:.1f}%, {by_round['rounds']} rounds)")
        print(f"  {move['line'].strip()}")
        if move["seconds"]:
            print(f"  moved {move['layers_moved']} layer(s) in {move['seconds']:.3f} s = "
                  f"{figures['move_vs_iteration']:.2f} iterations at the best split")
        if "drained_every_segment_vs_undrained" in figures:
            print(f"  draining every {args.segment_iterations} iterations: "
                  f"{100 * figures['drained_every_segment_vs_undrained']:.1f}% of the "
                  f"throughput undrained for {2 * args.segment_iterations}")
    return summary


if __name__ == "__main__":
    main()
