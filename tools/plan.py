"""Rank parallel configurations (t, p, d, micro batch, recomputation, schedule) for a model.

    python tools/plan.py --num-layers 32 --hidden-size 2304 --num-attention-heads 32 \\
        --seq-length 512 --vocab-size 50257 --fp16 --global-batch-size 512 \\
        --world-size 64 --hardware p3.16xlarge --top 10 --json plan.json --plot plan.png

Model, precision, optimizer and distributed-optimizer flags are pretrain_gpt.py's (--bert plans
pretrain_bert.py's model). A parallelism flag given on the command line pins that dimension
(--tensor-model-parallel-size, --pipeline-model-parallel-size, --pipeline-layer-split,
--micro-batch-size, --recompute-granularity / --recompute-activations, --pipeline-schedule).
--hardware is a YAML file, a shipped name (p3.16xlarge, dgx-a100, dgx-h100) or "local": this
machine, detected, with the model's pieces measured here (cached under --profile-cache).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_2bw.arguments import (ConfigError, build_parser, config_from_args,
                                    explicit_fields)
from megatron_2bw.cpu_threads import busy_machine_note
from megatron_2bw.planner.hardware import (HardwareSpec, detect_hardware, load_hardware,
                                           shipped_hardware)
from megatron_2bw.planner.measured_profile import architecture_name, default_cache_dir
from megatron_2bw.planner.search import (Plan, SearchSpace, pinned_search_space,
                                         measured_search, rank_plans_for)

PROGRAM = "plan.py"


def add_plan_args(parser) -> None:
    g = parser.add_argument_group("planning")
    g.add_argument("--world-size", type=int, required=True, help="devices to plan for")
    g.add_argument("--hardware", required=True,
                   help=f"YAML file, a shipped name ({', '.join(shipped_hardware())}) or 'local'")
    g.add_argument("--bert", action="store_true", help="plan pretrain_bert.py's model")
    g.add_argument("--top", type=int, default=10, help="configurations to print (default 10)")
    g.add_argument("--json", metavar="FILE", help="write every configuration, best first")
    g.add_argument("--plot", metavar="FILE.png", help="draw throughput and memory per configuration")
    g.add_argument("--profile-cache", metavar="DIR",
                   help=f"measured profiles for --hardware local (default {default_cache_dir()})")


def search_space(args, config) -> SearchSpace:
    """Dimensions the user typed on the command line are pinned."""
    return pinned_search_space(config, explicit_fields(args))


def local_hardware() -> HardwareSpec:
    """This machine as one process sees it (one device per node), measured here."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return detect_hardware()


def rows(plans: list[Plan], top: int) -> list[Plan]:
    """The top configurations, then each schedule's best if it is not among them."""
    shown = plans[:top]
    for schedule in ("2bw", "flush", "gpipe"):
        best = next((p for p in plans if p.candidate.schedule == schedule), None)
        if best is not None and best not in shown:
            shown.append(best)
    return shown


def format_table(plans: list[Plan], top: int) -> str:
    header = (f"{'#':>4} {'t':>2} {'p':>3} {'d':>4} {'b':>4} {'m':>5} {'recompute':>9} "
              f"{'schedule':>8} {'samples/s':>10} {'mem GiB':>8} {'fits':>5}  bottleneck"
              f"  (layer split)")
    lines = [header, "-" * len(header)]
    for plan in rows(plans, top):
        c, rank = plan.candidate, plans.index(plan) + 1
        estimate = "" if plan.simulated else "*"
        lines.append(
            f"{rank:>4} {c.tensor_parallel:>2} {c.pipeline_parallel:>3} {c.data_parallel:>4} "
            f"{c.micro_batch_size:>4} {plan.microbatches:>5} {c.recompute_label:>9} "
            f"{c.schedule:>8} {plan.throughput_samples_per_s:>9.1f}{estimate:1} "
            f"{max(plan.memory_bytes_per_stage) / 2**30:>8.2f} {'yes' if plan.fits else 'NO':>5}  "
            f"{plan.bottleneck}  ({','.join(map(str, c.layer_split or ()))})")
    limit = plans[0].memory_limit_bytes / 2**30
    lines.append(f"mem: the peak of the fullest stage, per device (usable: {limit:.2f} GiB). "
                 f"*: closed-form estimate (not replayed: cannot reach the top, or does not fit)")
    return "\n".join(lines)


def summary(plans: list[Plan]) -> str:
    """The last line: the best configuration, or that none fits and the smallest need."""
    limit = plans[0].memory_limit_bytes / 2**30
    if plans[0].fits:
        best = plans[0]
        return (f"best: {best.candidate.describe()}, {best.throughput_samples_per_s:.1f} "
                f"samples/s predicted, peak {max(best.memory_bytes_per_stage) / 2**30:.2f} of "
                f"{limit:.2f} GiB per device")
    least = min(plans, key=lambda plan: max(plan.memory_bytes_per_stage))
    return (f"no configuration fits in {limit:.2f} GiB per device: the smallest "
            f"({least.candidate.describe()}) needs {max(least.memory_bytes_per_stage) / 2**30:.2f} "
            f"GiB; plan more devices, a smaller model or --use-distributed-optimizer")


def plot(plans: list[Plan], top: int, path: Path, title: str) -> None:
    """Predicted throughput (bars) and every stage's memory (dots) against the usable memory."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = rows(plans, top)
    shown += [p for p in plans if not p.fits and p not in shown][:3]
    colors = {"2bw": "tab:blue", "flush": "tab:orange", "gpipe": "tab:green", "zb-h1": "tab:purple",
              "interleaved": "tab:brown"}
    labels = [f"{p.candidate.schedule} t{p.candidate.tensor_parallel} p{p.candidate.pipeline_parallel}"
              f" d{p.candidate.data_parallel} b{p.candidate.micro_batch_size}"
              f"{' ' + p.candidate.recompute_label if p.candidate.recompute_label != 'none' else ''}"
              for p in shown]
    x = list(range(len(shown)))
    fig, (top_ax, bottom_ax) = plt.subplots(2, 1, figsize=(max(8.0, 0.7 * len(shown)), 8),
                                            sharex=True)
    top_ax.bar(x, [p.throughput_samples_per_s for p in shown],
               color=[colors[p.candidate.schedule] for p in shown],
               hatch=["" if p.fits else "//" for p in shown],
               edgecolor=["none" if p.fits else "tab:red" for p in shown])
    top_ax.set_ylabel("predicted samples/s")
    top_ax.set_title(title)
    top_ax.legend(handles=[Patch(color=c, label=s) for s, c in colors.items()]
                  + [Patch(facecolor="white", edgecolor="tab:red", hatch="//",
                           label="does not fit")], loc="upper center", ncol=4)
    top_ax.set_ylim(0, 1.25 * max(p.throughput_samples_per_s for p in shown))
    for i, plan in enumerate(shown):
        stages = [m / 2**30 for m in plan.memory_bytes_per_stage]
        bottom_ax.scatter([i] * len(stages), stages, s=14,
                          color=colors[plan.candidate.schedule] if plan.fits else "tab:red")
    bottom_ax.axhline(plans[0].memory_limit_bytes / 2**30, color="black", linestyle="--",
                      label="usable memory per device")
    bottom_ax.set_ylabel("memory per stage (GiB)")
    bottom_ax.legend(loc="upper left")
    bottom_ax.set_xticks(x)
    bottom_ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[Plan]:
    args = build_parser(__doc__.split("\n")[0], add_plan_args).parse_args(argv)
    config = config_from_args(args, "bert" if args.bert else "gpt", require_data=False)
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be a positive integer, got {args.world_size}")
    if config.model.vocab_size <= 0:
        raise ConfigError("planning needs the vocabulary size: give --vocab-size N")
    if config.training.global_batch_size is None:
        raise ConfigError("planning needs --global-batch-size")
    if args.top < 1:
        raise ConfigError(f"--top must be a positive integer, got {args.top}")
    for flag, value in (("--json", args.json), ("--plot", args.plot)):
        if value and not Path(value).resolve().parent.is_dir():
            raise ConfigError(f"{flag} {value}: the directory does not exist")
    if args.plot:
        from matplotlib.figure import Figure
        formats = Figure().canvas.get_supported_filetypes()
        if Path(args.plot).suffix.lstrip(".").lower() not in formats:
            raise ConfigError(f"--plot {args.plot}: expected an image file name ending in one of "
                              f"{', '.join('.' + f for f in sorted(formats))}")
    profile, space = None, search_space(args, config)
    if args.hardware == "local":
        if args.world_size > 1:
            print(f"note: --hardware local is this machine as one process sees it, one device "
                  f"per node: {args.world_size} ranks are planned on {args.world_size} such "
                  f"machines. For ranks sharing this machine's cores, --auto-parallel at launch "
                  f"measures them together.", file=sys.stderr)
        busy = busy_machine_note()
        if busy is not None:
            print(f"note: {busy}", file=sys.stderr)
        hardware = local_hardware()
        profile, space = measured_search(config, args.world_size, hardware, space,
                                         args.profile_cache, progress=True)
    else:
        hardware = load_hardware(args.hardware)
    plans = rank_plans_for(config, args.world_size, hardware, profile, space,
                           simulate_top=args.top, progress=True)
    m = config.model
    layout = architecture_name(m).replace("-", " ") + (" sequence-parallel" if m.sequence_parallel
                                                       else "")
    title = (f"{m.model_type} L{m.num_layers} h{m.hidden_size}{layout}, "
             f"batch {config.training.global_batch_size}, {args.world_size} x {hardware.name}")
    print(title)
    print(format_table(plans, args.top))
    print(summary(plans))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "hardware": hardware.name, "world_size": args.world_size,
            "global_batch_size": config.training.global_batch_size,
            "configs": [plan.to_json() for plan in plans]}, indent=1))
    if args.plot:
        plot(plans, args.top, Path(args.plot), title)
    return plans


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as error:  # ConfigError and bad hardware files included
        print(f"{PROGRAM}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
