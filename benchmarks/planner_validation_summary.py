"""Planner validation reports summarized together: how often the targets held, and which
configurations the cost model misses the same way in every run.

    python benchmarks/planner_validation_summary.py docs/planner_validation_world4.json
    python benchmarks/planner_validation_summary.py run1.json run2.json run3.json
    python benchmarks/planner_validation_summary.py --repredict run*.json

docs/planner_validation_world4.json is the current result; to judge noise against model error,
keep the `--json` reports of several runs of benchmarks/planner_validation.py on your machine
and pass them all. One run judges the planner on one noisy sample of the machine. Pooled, the
reports tell noise from model error: noise moves every configuration of a run together (a
shared VM's speed can drift by 10-30%), so each error is also shown minus its run's median
error (its residual). A configuration whose residual keeps its sign in every run is one the
cost model gets wrong.

--repredict recomputes every prediction from each report's own sampled inputs (the detected
hardware and the profile, medians over the rounds, as the run used them) with the cost model of
this checkout: a change to the model is judged against every saved run before a new one is measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import planner_validation as validation  # noqa: E402

from megatron_2bw.planner.hardware import HardwareSpec  # noqa: E402
from megatron_2bw.planner.analytic_profile import AnalyticProfile  # noqa: E402
from megatron_2bw.planner.measured_profile import MeasuredProfile  # noqa: E402


def fail(message: str) -> None:
    print(f"planner_validation_summary.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def load_rows(path: Path) -> list[validation.Row]:
    """The report's rows (predicted and measured), as planner_validation.py wrote them."""
    try:
        report = json.loads(path.read_text())
        return [validation.Row(r["world_size"], r["config"], r["predicted_ms"], r["measured_ms"],
                               plan=r.get("plan"),
                               predicted_at_start_ms=r.get("predicted_at_start_ms", 0.0),
                               settle_ms=r.get("settle_ms", []))
                for r in report["rows"]]
    except FileNotFoundError:
        fail(f"{path}: no such file")
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        fail(f"{path}: not a report of benchmarks/planner_validation.py --json ({error!r})")


def _hardware(record: dict) -> HardwareSpec:
    fields = dict(record)
    for key in ("allreduce_times", "allreduce_processor_times", "allreduce_after_compute",
                "matmul_efficiency"):
        # JSON turned tuples into lists
        if fields.get(key) is not None:
            fields[key] = tuple(tuple(entry) for entry in fields[key])
    return HardwareSpec(**fields)


def repredict(path: Path, rows: list[validation.Row]) -> None:
    """Replace each row's prediction by this checkout's, from the report's sampled inputs."""
    report = json.loads(path.read_text())
    if not {"hardware", "profile"} <= set(report) or any(row.plan is None for row in rows):
        fail(f"{path}: keeps no sampled inputs (its 'hardware', 'profile' or rows' 'plan'); "
             f"--repredict needs a report of a newer planner_validation.py")
    # a report without 'argv' ran with the defaults, which its header shows
    config = validation.model_config(validation.parse_args(report.get("argv", [])))
    expected = validation.model_description(config)
    if not report.get("header", "").startswith(expected):
        fail(f"{path}: the report's header does not start with {expected!r}, the model its "
             f"arguments give; --repredict cannot rebuild its configurations")
    for world in {row.world_size for row in rows}:
        hardware = _hardware(report["hardware"][str(world)])
        records = {(int(t), int(b)): record for t, by_size in report["profile"][str(world)].items()
                   for b, record in by_size.items()}
        profile = MeasuredProfile(records, AnalyticProfile(config.model, config.precision,
                                                           hardware))
        for row in rows:
            if row.world_size == world:
                row.predicted_ms = validation.predict_pinned(config, world, hardware, profile,
                                                             row.plan)


@dataclass
class RunVerdict:
    name: str
    world_size: int
    verdict: dict
    median_error: float


def summarize(runs: dict[str, list[validation.Row]]) -> tuple[list[RunVerdict], dict]:
    """Per run and world size, the verdict; per (world size, configuration), its errors and
    residuals over the runs."""
    verdicts: list[RunVerdict] = []
    by_config: dict[tuple[int, str], dict[str, list[float]]] = {}
    for name, rows in runs.items():
        for world in sorted({row.world_size for row in rows}):
            group = [row for row in rows if row.world_size == world]
            validation.assign_ranks(group)
            median = statistics.median(row.error for row in group)
            verdicts.append(RunVerdict(name, world, validation.verdict(group), median))
            for row in group:
                entry = by_config.setdefault((world, row.config), {"errors": [], "residuals": []})
                entry["errors"].append(row.error)
                entry["residuals"].append(row.error - median)
    return verdicts, by_config


def markdown(verdicts: list[RunVerdict], by_config: dict) -> str:
    lines = ["| report | processes | within 20% | worst | median error | first choice |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for v in verdicts:
        d = v.verdict
        lines.append(f"| {v.name} | {v.world_size} | {d['within_20_percent']} of "
                     f"{d['configurations']} | {100 * d['worst_error']:+.1f}% | "
                     f"{100 * v.median_error:+.1f}% | {100 * d['first_choice_gap']:.1f}% |")
    rows = sum(v.verdict["configurations"] for v in verdicts)
    within = sum(v.verdict["within_20_percent"] for v in verdicts)
    chosen = sum(v.verdict["choice_target_holds"] for v in verdicts)
    reports = {v.name for v in verdicts}
    all_four = sum(all(v.verdict["error_target_holds"] and v.verdict["choice_target_holds"]
                       for v in verdicts if v.name == name) for name in reports)
    lines += ["", f"Pooled: {within} of {rows} predictions within 20%; the first choice within 5% "
                  f"of the measured best in {chosen} of {len(verdicts)}; every target held in "
                  f"{all_four} of {len(reports)} reports.", "",
              "Per configuration over the reports (residual: the error minus its run's median "
              "error; same sign: in every report):", "",
              "| processes | configuration | reports | mean error | mean residual | residuals "
              "min, max | same sign |", "| ---: | --- | ---: | ---: | ---: | --- | --- |"]
    for (world, config), entry in sorted(by_config.items(),
                                         key=lambda item: statistics.mean(item[1]["residuals"])):
        residuals = entry["residuals"]
        same_sign = len(residuals) > 1 and (min(residuals) > 0 or max(residuals) < 0)
        lines.append(f"| {world} | {config} | {len(residuals)} | "
                     f"{100 * statistics.mean(entry['errors']):+.1f}% | "
                     f"{100 * statistics.mean(residuals):+.1f}% | {100 * min(residuals):+.1f}%, "
                     f"{100 * max(residuals):+.1f}% | {'yes' if same_sign else ''} |")
    lines += ["", f"Residual standard deviation over all predictions: "
                  f"{100 * statistics.pstdev(r for e in by_config.values() for r in e['residuals']):.1f}%"]
    return "\n".join(lines)


def main(argv=None) -> tuple[list[RunVerdict], dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path,
                        help="JSON reports of benchmarks/planner_validation.py --json")
    parser.add_argument("--repredict", action="store_true",
                        help="recompute the predictions with this checkout's cost model from each "
                             "report's sampled inputs")
    args = parser.parse_args(argv)
    runs = {}
    for path in args.reports:
        rows = load_rows(path)
        if args.repredict:
            repredict(path, rows)
        runs[path.stem] = rows
    verdicts, by_config = summarize(runs)
    print(markdown(verdicts, by_config))
    return verdicts, by_config


if __name__ == "__main__":
    main()
