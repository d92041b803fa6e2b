"""Plot loss and throughput against iteration for one or more training runs.

    python tools/plot_logs.py runs/a/log.jsonl runs/b --output curves.png --labels baseline 2bw

Each run is a --log-file JSON-lines file, or a directory holding *.jsonl log files or TensorBoard
event files (--tensorboard-dir).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Preferred loss keys, in order; otherwise the first key ending in "loss" (e.g. "sop loss").
LOSS_KEYS = ("lm loss", "loss")
THROUGHPUT_KEY = "tokens-per-sec"


class LogError(ValueError):
    """A run that cannot be plotted; the message names the file and what was expected."""


@dataclass
class RunCurves:
    loss_key: str
    loss: dict[int, float] = field(default_factory=dict)  # iteration -> value
    tokens_per_sec: dict[int, float] = field(default_factory=dict)


def _read_jsonl(path: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise LogError(f"{path}:{line_number}: not a JSON object ({error.msg})") from None
            if not isinstance(record, dict) or "iteration" not in record:
                continue  # text records (config, plan) carry no metrics
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):
                    # A resumed run repeats iterations after its checkpoint: the last record wins.
                    series.setdefault(key, {})[int(record["iteration"])] = float(value)
    return series


def _read_tensorboard(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, float]] = {}
    event_dirs = sorted({path.parent for path in directory.rglob("events.out.tfevents.*")})
    for event_dir in event_dirs:
        accumulator = EventAccumulator(str(event_dir), size_guidance={"scalars": 0})  # 0: keep all
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            for event in accumulator.Scalars(tag):
                series.setdefault(tag, {})[event.step] = event.value
    return series


def _read_series(path: Path) -> dict[str, dict[int, float]]:
    if not path.exists():
        raise LogError(f"{path}: no such file or directory (expected a --log-file JSON-lines file "
                       f"or a directory of *.jsonl or TensorBoard event files)")
    if path.is_file():
        if path.name.startswith("events.out.tfevents."):
            return _read_tensorboard(path.parent)
        return _read_jsonl(path)
    jsonl_files = sorted(path.glob("*.jsonl"))
    if jsonl_files:
        series: dict[str, dict[int, float]] = {}
        for jsonl in jsonl_files:
            for key, points in _read_jsonl(jsonl).items():
                series.setdefault(key, {}).update(points)
        return series
    if any(path.rglob("events.out.tfevents.*")):
        return _read_tensorboard(path)
    raise LogError(f"{path}: directory holds no *.jsonl log files or TensorBoard event files")


def load_run(path: str | Path) -> RunCurves:
    """Loss and tokens/s series of one run; LogError if it is missing or has no loss records."""
    path = Path(path)
    series = _read_series(path)
    loss_key = next((key for key in LOSS_KEYS if key in series), None)
    if loss_key is None:
        loss_key = next((key for key in series if key.endswith("loss")), None)
    if loss_key is None or not series[loss_key]:
        raise LogError(f"{path}: no loss records (expected a metric named 'lm loss' or ending in "
                       f"'loss'; found: {', '.join(sorted(series)) or 'no metrics'})")
    return RunCurves(loss_key, series[loss_key], series.get(THROUGHPUT_KEY, {}))


def plot_runs(runs: list[RunCurves], labels: list[str], output: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    figure, (loss_axes, speed_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (run, label) in enumerate(zip(runs, labels)):
        style = {"label": label, "color": f"C{index}"}  # one colour per run in both panels
        iterations = sorted(run.loss)
        loss_axes.plot(iterations, [run.loss[i] for i in iterations], **style)
        if run.tokens_per_sec:
            iterations = sorted(run.tokens_per_sec)
            speed_axes.plot(iterations, [run.tokens_per_sec[i] for i in iterations], **style)
    loss_keys = sorted({run.loss_key for run in runs})
    loss_axes.set(title="training loss", xlabel="iteration", ylabel=" / ".join(loss_keys))
    speed_axes.set(title="throughput", xlabel="iteration", ylabel="tokens/s")
    if not any(run.tokens_per_sec for run in runs):
        speed_axes.text(0.5, 0.5, f"no '{THROUGHPUT_KEY}' records", ha="center", va="center",
                        transform=speed_axes.transAxes)
    for axes in (loss_axes, speed_axes):
        axes.grid(alpha=0.3)
        if axes.lines:
            axes.legend()
    figure.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="--log-file JSONL files or log directories")
    parser.add_argument("--output", default="curves.png", help="PNG file to write")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the paths)")
    args = parser.parse_args(argv)
    try:
        if args.labels is not None and len(args.labels) != len(args.runs):
            raise LogError(f"--labels got {len(args.labels)} labels for {len(args.runs)} runs")
        runs = [load_run(path) for path in args.runs]
    except (LogError, OSError) as error:
        print(f"plot_logs.py: error: {error}", file=sys.stderr)
        return 2
    labels = args.labels or args.runs
    plot_runs(runs, labels, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
