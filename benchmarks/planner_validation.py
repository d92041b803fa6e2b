"""Measured against predicted: the planner's time per iteration for every configuration it considers
for a small GPT on this machine, next to the runtime's measured time per iteration.

    python benchmarks/planner_validation.py --world-sizes 2 4 --repeats 3 \
        --json planner_validation.json --markdown planner_validation.md

For each world size the hardware is detected by the job's own ranks (`detect_hardware`, as
`--hardware local` does), the model's layer, embedding and head are profiled here
(`measured_profile_for`: in as many forked processes at once as the job's ranks will keep the
node's cores busy), and `rank_plans_for` costs and replays every configuration of the search
space. Each fitting configuration is then trained by the real runtime (`build_stage` +
`run_segment`, the code `pretrain_gpt.py` runs) on freshly forked gloo ranks with one thread each;
its time per iteration is the mean interval between the ends of its batches after the warm-up
batches (what the "elapsed time per iteration" log line reports, in steady state).
Configurations are interleaved and repeated, because this shared machine is noisy; the table
gives the medians. Each round runs them in its own seeded random order (`interleave.py`).

This VM's speed drifts by 20-30% over minutes (two 5-round profiles a minute apart differ that
much), so inputs measured once at the start describe a different machine than the runs minutes
later. Before every round the hardware is detected again and the pieces profiled once more; the
predictions that are checked come from the medians of those samples, taken over the same minutes
as the measurements (the configurations and their layer splits are those chosen at the start;
the start-of-run predictions are reported beside them).

Then the contenders get more rounds (--settle-rounds): the planner's first choice and every
configuration whose median is within --settle-margin of the fastest. Near-equal configurations
measured a few times each come out in an order decided by noise, and the least of several noisy
medians is biased low, so the first-choice verdict (medians over every run) gets the rounds it
turns on. Each error is judged on the main rounds, whose minutes the predictions' inputs come from.

Targets (issue 8): every configuration within 20% of its prediction, and the planner's first choice
the measured best or within 5% of it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # run from a checkout
                str(Path(__file__).resolve().parent)]

from megatron_2bw.arguments import parse_config  # noqa: E402
from megatron_2bw.config import Config  # noqa: E402
from megatron_2bw.distributed.forked import run_forked  # noqa: E402
from megatron_2bw.distributed.launch import pick_device  # noqa: E402
from megatron_2bw.distributed.layout import ParallelLayout  # noqa: E402
from megatron_2bw.planner.cost import RECOMPUTE_OPTIONS  # noqa: E402
from megatron_2bw.planner.hardware import HardwareSpec, detect_hardware  # noqa: E402
from megatron_2bw.planner.analytic_profile import AnalyticProfile  # noqa: E402
from megatron_2bw.planner.measured_profile import (MeasuredProfile,  # noqa: E402
                                                   measure_costs_per_copy, measure_turn_taking,
                                                   median_record, profiling_processes,
                                                   turn_taking_processors)
from megatron_2bw.planner.search import (Plan, SearchSpace, apply_plan,  # noqa: E402
                                         measured_profile_for, rank_plans_for)
from megatron_2bw.training.segments import run_segment  # noqa: E402
from megatron_2bw.training.stage import build_stage  # noqa: E402
from interleave import round_order  # noqa: E402

ERROR_TARGET = 0.20  # |measured - predicted| / measured, every configuration
CHOICE_TARGET = 0.05  # the first choice's measured time over the measured best's, minus one


def on_ranks(world: int, fn, *args, timeout: float = 600.0) -> list:
    """fn(rank, world, *args) on `world` forked ranks, NCCL with CUDA, gloo otherwise."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return run_forked(world, fn, *args, backend=backend, timeout=timeout)


# -- what a rank does ----------------------------------------------------------------------------

def _detect(rank: int, world: int) -> HardwareSpec:
    return detect_hardware()


def _train(rank: int, world: int, config: Config, warmup: int, measured: int) -> list[float]:
    """Seconds of each measured batch on this rank (their mean is its time per iteration): the
    intervals between the ends of its batches (its gradient reduction, right after a batch's last
    backward in every schedule) after `warmup` batches, all batches in one undrained segment (as
    pretrain runs between evaluations). Not the optimizer steps: 2BW defers a batch's step into
    the next batch, and its last two steps both fall into the final drain."""
    par = config.parallel
    layout = ParallelLayout(world, par.tensor_parallel, par.pipeline_parallel, rank)
    layout.build_groups(par.timeout_minutes)
    device = pick_device(rank)
    batch_ends: list[float] = []  # StepResult.ended_at: when the rank began reducing the batch
    stage = build_stage(config, layout, device, None,
                        on_step=lambda result: batch_ends.append(result.ended_at))
    model = config.model
    generator = torch.Generator().manual_seed(1000 + layout.coords.dp)
    tokens = torch.randint(0, model.vocab_size, (8, config.training.micro_batch_size,
                                                 model.seq_length + 1), generator=generator)
    dist.barrier()
    run_segment(stage, 0, warmup + measured, lambda k: {"tokens": tokens[k % 8].to(device)})
    dist.barrier()
    return [end - before for before, end in zip(batch_ends[warmup - 1:-1], batch_ends[warmup:])]


# -- the benchmark -------------------------------------------------------------------------------

@dataclass
class Row:
    world_size: int
    config: str
    predicted_ms: float  # from the inputs sampled over the rounds (the start's until then)
    measured_ms: list[float]  # one per repeat
    rank_predicted: int = 0
    rank_measured: int = 0
    plan: dict | None = None
    predicted_at_start_ms: float = 0.0
    settle_ms: list[float] = field(default_factory=list)  # the settling rounds' (contenders only)
    # per run (the repeats', then the settling rounds'), the slowest rank's milliseconds of each
    # measured batch: whether a slow run was slow throughout or in bursts
    batch_ms: list[list[float]] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.measured_ms)

    @property
    def settled_ms(self) -> float:
        """The median over every run of this configuration, settling rounds included."""
        return statistics.median(self.measured_ms + self.settle_ms)

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_ms - self.median_ms) / self.median_ms


def model_config(args) -> Config:
    argv = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads),
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--vocab-size", str(args.vocab_size), "--global-batch-size", str(args.global_batch_size),
            "--micro-batch-size", "1", "--train-iters", "1000000", "--lr", "1e-4",
            "--optimizer", "adam", "--mock-data"]
    config, _ = parse_config(argv, "gpt", require_data=False)
    return config


def predict(config: Config, world: int, space: SearchSpace, profile_cache: str | None,
            progress: bool) -> tuple[HardwareSpec, list[Plan]]:
    """Detect the hardware with `world` ranks, profile here, and replay every configuration."""
    hardware = on_ranks(world, _detect)[0]
    profile = measured_profile_for(config, world, hardware, space, list(space.micro_batch_sizes),
                                   profile_cache, progress=progress)
    plans = rank_plans_for(config, world, hardware, profile, space, simulate_top=10 ** 6)
    return hardware, [plan for plan in plans if plan.fits]


@dataclass
class Samples:
    """The inputs of the predictions, sampled once per round."""
    hardware: dict[int, list[HardwareSpec]]  # per world size
    # per number of processes profiling at once (profiling_processes), per (t, b), per round:
    # every copy's record (the prediction uses the median over copies, then over rounds)
    profile: dict[int, dict[tuple[int, int], list[list[dict]]]]
    processes: dict[int, int]  # per world size
    # per number of processes profiling at once: the processors its world sizes' ranks take
    # turns on, where they do (turn_taking_processors), measured into each round's records
    turn_taking: dict[int, int] = field(default_factory=dict)

    def take(self, config: Config) -> None:
        for world, specs in self.hardware.items():
            specs.append(on_ranks(world, _detect)[0])
        for processes, by_size in self.profile.items():
            measured = measure_costs_per_copy(config.model, config.precision, list(by_size),
                                              processes)
            if self.turn_taking.get(processes):
                overheads = measure_turn_taking(config.model, config.precision, list(by_size),
                                                self.turn_taking[processes])
                for key, copies in measured.items():
                    for copy in copies:
                        copy["turn_taking_overhead"] = overheads[key]
            for key, copies in measured.items():
                by_size[key].append(copies)

    def rounds(self, world: int) -> dict[tuple[int, int], list[dict]]:
        """Per (t, b), each round's record: the median over the copies."""
        return {key: [median_record(copies) for copies in runs]
                for key, runs in self.profile[self.processes[world]].items()}

    def inputs(self, config: Config, world: int) -> tuple[HardwareSpec, MeasuredProfile]:
        hardware = HardwareSpec.median(self.hardware[world])
        records = {key: median_record(runs) for key, runs in self.rounds(world).items()}
        return hardware, MeasuredProfile(records, AnalyticProfile(config.model, config.precision,
                                                                  hardware))


def slowest_rank(batches_per_rank: list[list[float]]) -> list[float]:
    """The batch times (_train's) of the rank with the longest time per iteration."""
    return max(batches_per_rank, key=statistics.mean)


def time_ms(row: Row, row_config: Config, warmup: int, measured: int) -> float:
    """One run of a configuration: its slowest rank's milliseconds per iteration (that rank's
    batches into row.batch_ms)."""
    slowest = slowest_rank(on_ranks(row.world_size, _train, row_config, warmup, measured))
    row.batch_ms.append([1000 * seconds for seconds in slowest])
    return 1000 * statistics.mean(slowest)


def run_rounds(rows: list[tuple[Row, Config]], warmup: int, measured: int,
               round_indices: range, runs_of, description: str, progress: bool,
               before_round=lambda: None) -> list[list[int]]:
    """Every configuration once per round, each round in its own order, each time appended to
    runs_of(row) (returned: per round, indices into `rows`)."""
    from tqdm import tqdm
    orders = []
    with tqdm(total=len(round_indices) * len(rows), desc=description, unit="run",
              disable=not progress) as bar:
        for round_index in round_indices:
            before_round()
            orders.append(round_order(len(rows), round_index))
            for index in orders[-1]:
                row, row_config = rows[index]
                runs_of(row).append(time_ms(row, row_config, warmup, measured))
                bar.update()
    return orders


def measure(rows: list[tuple[Row, Config]], samples: Samples, config: Config, warmup: int,
            measured: int, repeats: int, progress: bool) -> list[list[int]]:
    """Interleaved: the inputs sampled, then every configuration once, per round."""
    return run_rounds(rows, warmup, measured, range(repeats), lambda row: row.measured_ms,
                      "training", progress, before_round=lambda: samples.take(config))


def contenders(rows: list[Row], margin: float) -> list[Row]:
    """The configurations the first-choice verdict turns on: the first choice, and every one whose
    median lies within `margin` of the fastest median. None when the first choice is alone."""
    fastest = min(row.median_ms for row in rows)
    first = min(rows, key=lambda r: r.predicted_ms)
    chosen = [row for row in rows if row is first or row.median_ms <= (1 + margin) * fastest]
    return chosen if len(chosen) > 1 else []


def settle(rows: list[tuple[Row, Config]], warmup: int, measured: int, rounds: int,
           first_round: int, progress: bool) -> list[list[int]]:
    """More interleaved rounds of the contenders only, into their `settle_ms`. The median of a
    few noisy runs of near-equal configurations picks a fastest by luck, and the least of several
    such medians is biased low: the rounds spent where the verdict is decided shrink both."""
    return run_rounds(rows, warmup, measured, range(first_round, first_round + rounds),
                      lambda row: row.settle_ms, "settling", progress)


def predict_pinned(config: Config, world: int, hardware: HardwareSpec, profile: MeasuredProfile,
                   plan: dict) -> float:
    """Milliseconds per iteration predicted for one measured configuration (its layer split as
    chosen at the start)."""
    recompute = None if plan["recompute"] == "none" else plan["recompute"]
    space = SearchSpace(tensor_parallel=(plan["tensor_parallel"],),
                        micro_batch_sizes=(plan["micro_batch_size"],), recompute=(recompute,),
                        schedules=(plan["schedule"],), layer_split=tuple(plan["layer_split"]))
    [pinned] = rank_plans_for(config, world, hardware, profile, space, simulate_top=1)
    return 1000 * pinned.time_per_batch_s


def model_description(config: Config) -> str:
    """How a report's header begins: the model and batch its rows were measured with."""
    m = config.model
    return (f"GPT: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
            f"sequence {m.seq_length}, vocabulary {m.vocab_size}, fp32, Adam, global batch "
            f"{config.training.global_batch_size}")


def assign_ranks(rows: list[Row]) -> None:
    """1-based ranks by predicted and by measured time, within a world size. Measured: after
    settling rounds, the contenders first, by their medians over every run; then the others, by
    their main rounds. The two are medians over different minutes of a drifting machine, and a
    non-contender was already more than the settling margin (above the 5% target) behind the
    fastest in the rounds they shared."""
    def measured(row: Row):  # without settling rounds every row is left out alike
        left_out = not row.settle_ms
        return left_out, row.settled_ms

    for by, field_name in ((lambda r: r.predicted_ms, "rank_predicted"), (measured, "rank_measured")):
        for position, row in enumerate(sorted(rows, key=by), 1):
            setattr(row, field_name, position)


def verdict(rows: list[Row]) -> dict:
    """The targets: each error over the main rounds (measured in the minutes the predictions'
    inputs were sampled in); the first choice against the measured best (rank_measured 1, see
    assign_ranks), both over every run."""
    worst = max(rows, key=lambda r: abs(r.error))
    first = min(rows, key=lambda r: r.rank_predicted)
    best = min(rows, key=lambda r: r.rank_measured)
    choice_gap = first.settled_ms / best.settled_ms - 1
    return {"configurations": len(rows),
            "within_20_percent": sum(abs(r.error) <= ERROR_TARGET for r in rows),
            "worst_error": worst.error, "worst_config": worst.config,
            "error_target_holds": abs(worst.error) <= ERROR_TARGET,
            "first_choice": first.config, "measured_best": best.config,
            "first_choice_gap": choice_gap, "choice_target_holds": choice_gap <= CHOICE_TARGET}


def markdown(rows_by_world: dict[int, list[Row]], verdicts: dict[int, dict], header: str) -> str:
    lines = [header, ""]
    for world, rows in rows_by_world.items():
        v = verdicts[world]
        lines += [f"### {world} processes", "",
                  "| config | predicted ms/iter | measured ms/iter (median) | min-max | error % "
                  "| with settling rounds (runs) | rank predicted | rank measured "
                  "| predicted at start |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in sorted(rows, key=lambda r: r.rank_predicted):
            runs = len(row.measured_ms) + len(row.settle_ms)
            settled = f"{row.settled_ms:.0f} ({runs})" if row.settle_ms else "-"
            lines.append(f"| {row.config} | {row.predicted_ms:.0f} | {row.median_ms:.0f} | "
                         f"{min(row.measured_ms):.0f}-{max(row.measured_ms):.0f} | "
                         f"{100 * row.error:+.1f} | {settled} | {row.rank_predicted} | "
                         f"{row.rank_measured} | {row.predicted_at_start_ms:.0f} |")
        lines += ["", f"- within 20%: {v['within_20_percent']} of {v['configurations']} "
                      f"(worst {100 * v['worst_error']:+.1f}%, {v['worst_config']}): "
                      f"**{'holds' if v['error_target_holds'] else 'does not hold'}**",
                  f"- first choice {v['first_choice']}; measured best {v['measured_best']}; "
                  f"the first choice is {100 * v['first_choice_gap']:.1f}% slower (medians over "
                  f"every run, settling rounds included): "
                  f"**{'holds' if v['choice_target_holds'] else 'does not hold'}**", ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[2, 4],
                        help="the micro batch sizes searched and measured (a restriction)")
    parser.add_argument("--recompute", nargs="+", default=["none"],
                        choices=["none", "selective", "full"],
                        help="recomputation options searched and measured (a restriction)")
    parser.add_argument("--warmup-batches", type=int, default=2)
    parser.add_argument("--measured-batches", type=int, default=8,
                        help="batches timed per run (8 gave steadier medians than 4 here)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settle-rounds", type=int, default=6,
                        help="after the rounds, this many more of the contenders only: the first "
                             "choice and every configuration within --settle-margin of the "
                             "fastest (0: none)")
    parser.add_argument("--settle-margin", type=float, default=0.10,
                        help="how far behind the fastest median a contender may be (default 0.10)")
    parser.add_argument("--profile-cache", default=None,
                        help="directory of the profile cache (default: a fresh temporary one)")
    parser.add_argument("--json", default=None, help="write every row and the verdicts here")
    parser.add_argument("--markdown", default=None, help="write the tables here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    for name in ("world_sizes", "micro_batch_sizes"):
        if any(x < 1 for x in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} must be positive integers")
    if args.warmup_batches < 1 or args.measured_batches < 1 or args.repeats < 1:
        parser.error("--warmup-batches, --measured-batches and --repeats must be at least 1")
    if args.settle_rounds < 0 or args.settle_margin < 0:
        parser.error("--settle-rounds and --settle-margin must not be negative")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the profile runs here like one rank
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # import once; forked ranks inherit
    config = model_config(args)
    space = SearchSpace(micro_batch_sizes=tuple(args.micro_batch_sizes),
                        recompute=tuple(None if r == "none" else r for r in args.recompute))
    assert set(space.recompute) <= set(RECOMPUTE_OPTIONS)
    progress = not args.no_progress
    cache = args.profile_cache or tempfile.mkdtemp(prefix="planner_validation_")
    load_before = os.getloadavg()[0]

    rows_by_world: dict[int, list[Row]] = {}
    pending: list[tuple[Row, Config]] = []
    samples = Samples({world: [] for world in args.world_sizes}, {}, {})
    for world in args.world_sizes:
        hardware, plans = predict(config, world, space, cache, progress)
        processes = samples.processes[world] = profiling_processes(hardware, world)
        samples.turn_taking[processes] = max(samples.turn_taking.get(processes, 0),
                                             turn_taking_processors(hardware, world))
        rows = []
        for plan in plans:
            row = Row(world, plan.candidate.describe(), 1000 * plan.time_per_batch_s, [],
                      plan=plan.to_json(), predicted_at_start_ms=1000 * plan.time_per_batch_s)
            rows.append(row)
            pending.append((row, apply_plan(config, plan)))
            samples.profile.setdefault(processes, {}).setdefault(
                (plan.candidate.tensor_parallel, plan.candidate.micro_batch_size), [])
        rows_by_world[world] = rows
    orders = measure(pending, samples, config, args.warmup_batches, args.measured_batches,
                     args.repeats, progress)
    contended = {id(row) for rows in rows_by_world.values()
                 for row in contenders(rows, args.settle_margin)}
    settling = [(row, row_config) for row, row_config in pending if id(row) in contended]
    settle_orders = settle(settling, args.warmup_batches, args.measured_batches,
                           args.settle_rounds if settling else 0, args.repeats, progress)
    load_after = os.getloadavg()[0]
    hardware_by_world: dict[int, dict] = {}
    for world, rows in rows_by_world.items():
        hardware, profile = samples.inputs(config, world)
        hardware_by_world[world] = asdict(hardware)
        for row in rows:
            row.predicted_ms = predict_pinned(config, world, hardware, profile, row.plan)

    verdicts = {}
    for world, rows in rows_by_world.items():
        assign_ranks(rows)
        verdicts[world] = verdict(rows)
    header = (f"{model_description(config)}; micro batch sizes "
              f"{', '.join(map(str, args.micro_batch_sizes))}; recomputation "
              f"{', '.join(args.recompute)}; {args.warmup_batches} warm-up + "
              f"{args.measured_batches} measured batches, {args.repeats} interleaved repeats (hardware "
              f"and profile sampled before each), then {len(settle_orders)} settling rounds of "
              f"{len(settling)} contenders (within {100 * args.settle_margin:.0f}% of the fastest, "
              f"or the first choice); "
              f"load average {load_before:.2f} before, {load_after:.2f} after.")
    # the inputs of both predictions, so they can be recomputed from this report alone (with
    # another cost model): the medians of the samples and the start's profile cache files
    sampled_profile: dict[str, dict] = {}  # per world size, as the predictions used it
    profile_copies: dict[str, dict] = {}  # per world size, (t, b), round: every copy's record
    for world, processes in samples.processes.items():
        for (t, b), records in sorted(samples.rounds(world).items()):
            sampled_profile.setdefault(str(world), {}).setdefault(str(t), {})[str(b)] = \
                median_record(records)
            profile_copies.setdefault(str(world), {}).setdefault(str(t), {})[str(b)] = \
                samples.profile[processes][(t, b)]
    start_profiles = {path.name: json.loads(path.read_text())
                      for path in Path(cache).glob("*.json")}
    report = {"header": header, "argv": list(sys.argv[1:] if argv is None else argv),
              "load_average": [load_before, load_after],
              "hardware": hardware_by_world,
              "hardware_rounds": {str(world): [asdict(spec) for spec in specs]
                                  for world, specs in samples.hardware.items()},
              "profile": sampled_profile,
              "profile_copies": profile_copies,
              "profiles_at_start": start_profiles, "verdicts": verdicts,
              # per round, the configurations in the order they ran (indices into "rows")
              "orders": orders,
              # the contenders (world size, configuration) and, per settling round, the order
              # they ran in (indices into "settling")
              "settling": [[row.world_size, row.config] for row, _ in settling],
              "settle_orders": settle_orders,
              "rows": [{**asdict(row), "median_ms": row.median_ms, "error": row.error}
                       for rows in rows_by_world.values() for row in rows]}
    text = markdown(rows_by_world, verdicts, header)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
