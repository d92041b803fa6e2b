"""Timers, log sinks (TensorBoard, Weights & Biases, a JSON-lines file) and the profiler of a
training run.

The sinks write on one rank only (the writer, which holds the loss); every other rank gets a
logger that does nothing, so the training loop can call it unconditionally.
"""
from __future__ import annotations

import collections
import datetime
import json
import netrc
import os
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron_2bw.config import LoggingConfig
from megatron_2bw.distributed.comm import all_reduce


class Timer:
    """Accumulates wall-clock seconds between start() and stop() calls."""

    def __init__(self, name: str, synchronize: Callable[[], None] | None = None):
        self.name = name
        self._synchronize = synchronize
        self._accumulated = 0.0
        self._started_at: float | None = None

    def _now(self) -> float:
        # Asynchronous devices (CUDA) queue work: wait for it so the clock measures the work itself.
        if self._synchronize is not None:
            self._synchronize()
        return time.perf_counter()

    def start(self) -> None:
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        self._started_at = self._now()

    def stop(self) -> None:
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name!r} was stopped without being started")
        self._accumulated += self._now() - self._started_at
        self._started_at = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated since the last reset, including a still-running interval."""
        total = self._accumulated
        if self._started_at is not None:
            now = self._now()
            total += now - self._started_at
            if reset:
                self._started_at = now  # a running timer keeps running from here
        if reset:
            self._accumulated = 0.0
        return total


class _DisabledTimer:
    """Stands in for a timer above the log level, so timing calls cost (almost) nothing."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def elapsed(self, reset: bool = True) -> float:
        return 0.0


_DISABLED_TIMER = _DisabledTimer()


class Timers:
    """Named timers, enabled by level: timers(name, level) is a no-op when level > log_level
    (--timing-log-level), so instrumented code costs nothing when timing is off."""

    def __init__(self, log_level: int, synchronize: Callable[[], None] | None = None):
        self.log_level = log_level
        self._synchronize = synchronize
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str, level: int = 1) -> Timer | _DisabledTimer:
        if level > self.log_level:
            return _DISABLED_TIMER
        if name not in self._timers:
            self._timers[name] = Timer(name, self._synchronize)
        return self._timers[name]

    def summary(self, reset: bool = True) -> dict[str, float]:
        """Seconds accumulated per enabled timer since the last reset."""
        return {name: timer.elapsed(reset) for name, timer in self._timers.items()}


# the runtime's timers (pipeline/executor.py, pipeline/update.py), all at level 1
TIMER_NAMES = ("forward", "backward", "p2p-wait", "allreduce", "optimizer")


class TimersAcrossRanks:
    """Each log interval's timers as (min, max) over the job's ranks, printed by the writer, as
    Megatron-LM prints its timers with --timing-log-level >= 1.

    The ranks end an interval at different points of their schedules (2BW never drains), so a
    blocking collective there would hold every rank until the last reached its point: a bubble
    per interval. Each interval's figures therefore go out in one non-blocking all-reduce on a
    group of their own (gloo: no device sync, no second device communicator); the writer prints
    them at a later step, once every rank's are in, and `finish` waits for the rest (every rank
    submits every interval)."""

    def __init__(self, group, is_writer: bool):
        self.group, self.is_writer = group, is_writer  # group None: this process alone
        self._pending: collections.deque = collections.deque()

    def submit(self, first: int, last: int, milliseconds: dict[str, float]) -> None:
        """This rank's milliseconds per iteration of iterations first..last, by timer name."""
        values = [milliseconds.get(name, 0.0) for name in TIMER_NAMES]
        # one MAX all-reduce gives both: the max of the values and of their negations
        figures = torch.tensor(values + [-v for v in values], dtype=torch.float64)
        work = all_reduce(figures, self.group, op=dist.ReduceOp.MAX, async_op=True)
        self._pending.append((first, last, figures, work))
        self.print_ready()

    def print_ready(self, wait: bool = False) -> None:
        """Print the intervals whose exchange has completed (all of them with `wait`), in order."""
        while self._pending:
            first, last, figures, work = self._pending[0]
            if work is not None and not (wait or work.is_completed()):
                return
            self._pending.popleft()
            if work is not None:
                work.wait()
            if self.is_writer:
                print(format_timers(first, last, figures.tolist()), flush=True)

    def finish(self) -> None:
        self.print_ready(wait=True)


def format_timers(first: int, last: int, figures: list[float]) -> str:
    """Megatron-LM's timer block; `figures`: the maxima, then the negated minima (TIMER_NAMES
    order)."""
    n = len(TIMER_NAMES)
    lines = [f" (min, max) time across ranks (ms per iteration, iterations {first}-{last}):"]
    for i, name in enumerate(TIMER_NAMES):
        lines.append(f"    {name + ' ':.<40}: ({-figures[n + i]:.2f}, {figures[i]:.2f})")
    return "\n".join(lines)


def measured_bubble_fraction(summary: dict[str, float], batch_time: float) -> float:
    """Estimated idle fraction of this rank's batch: 1 - (forward+backward+optimizer) / batch_time.

    It is an estimate: the remainder also holds data loading, communication that is not overlapped
    and Python overhead, so it is an upper bound on the pipeline bubble proper. `summary` comes from
    Timers.summary() over the same batches as `batch_time` (seconds), so the timers "forward",
    "backward" and "optimizer" must be enabled (--timing-log-level high enough).
    """
    if batch_time <= 0:
        raise ValueError(f"batch_time must be positive seconds, got {batch_time}")
    missing = [name for name in ("forward", "backward", "optimizer") if name not in summary]
    if missing:
        raise ValueError(f"bubble fraction needs the timers {missing}; raise --timing-log-level")
    busy = summary["forward"] + summary["backward"] + summary["optimizer"]
    return min(1.0, max(0.0, 1.0 - busy / batch_time))


def _wandb_api_key_configured() -> bool:
    """True when W&B could log in without asking: WANDB_API_KEY or a netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    netrc_path = os.environ.get("NETRC", os.path.join(os.path.expanduser("~"), ".netrc"))
    try:
        return netrc.netrc(netrc_path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode() -> str:
    """WANDB_MODE if set; else "online" with an API key configured and "offline" without one
    (wandb itself would stop with an error asking for a login)."""
    return os.environ.get("WANDB_MODE") or ("online" if _wandb_api_key_configured() else "offline")


class TrainingLogger:
    """Writes metric records to TensorBoard, W&B and/or a JSON-lines file, on the writer rank only.

    W&B is best effort: if it cannot start or log, one warning is printed and training goes on
    without it.
    """

    def __init__(self, config: LoggingConfig, is_writer: bool, run_config: dict):
        self._tensorboard = None
        self._wandb_run = None
        self._jsonl = None
        if not is_writer:
            return
        if config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=config.tensorboard_dir, flush_secs=30)
            config_text = json.dumps(run_config, indent=2)
            self._tensorboard.add_text("config", _as_markdown_code(config_text))
        if config.wandb_project:
            self._start_wandb(config, run_config)
        if config.log_file:
            Path(config.log_file).parent.mkdir(parents=True, exist_ok=True)
            # Append: a resumed run continues the same file (tools/plot_logs.py keeps the last
            # record of an iteration that appears twice).
            self._jsonl = open(config.log_file, "a", encoding="utf-8")

    def _start_wandb(self, config: LoggingConfig, run_config: dict) -> None:
        try:
            import wandb

            if config.wandb_save_dir:
                Path(config.wandb_save_dir).mkdir(parents=True, exist_ok=True)
            self._wandb_run = wandb.init(project=config.wandb_project, name=config.wandb_exp_name,
                                         dir=config.wandb_save_dir, config=run_config,
                                         mode=wandb_mode())
        except Exception as error:  # W&B must never stop training
            self._disable_wandb(error)

    def _disable_wandb(self, error: Exception) -> None:
        print(f"WARNING: Weights & Biases logging disabled: {type(error).__name__}: {error}",
              flush=True)
        self._wandb_run = None

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        """One record of the iteration's metrics; nothing when there are none."""
        if not metrics:
            return
        values = {key: float(value) for key, value in metrics.items()}
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, iteration)
        if self._wandb_run is not None:
            try:
                self._wandb_run.log(values, step=iteration)
            except Exception as error:
                self._disable_wandb(error)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"iteration": iteration, **values}) + "\n")
            self._jsonl.flush()

    def log_text(self, key: str, text: str) -> None:
        """A block of text such as the resolved config or the parallel plan."""
        if self._tensorboard is not None:
            self._tensorboard.add_text(key, _as_markdown_code(text))
        if self._wandb_run is not None:
            try:
                self._wandb_run.summary[key] = text
            except Exception as error:
                self._disable_wandb(error)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"text": key, "value": text}) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish()
            except Exception as error:
                self._disable_wandb(error)
            self._wandb_run = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> "TrainingLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class IterationProfiler:
    """--profile: torch.profiler (CPU activity, and CUDA's on a GPU) over the iterations
    [profile_step_start, profile_step_end) on the global ranks of --profile-ranks, written as one
    Chrome trace per rank (chrome://tracing, Perfetto, or TensorBoard's profiler plugin, which
    reads *.pt.trace.json) into --tensorboard-dir, else the --log-file's directory, else the
    working directory. Iterations count as the schedule's batches (0-based: the log line of
    batch b says iteration b + 1). The training loop drains the pipeline at both bounds
    (training.segment_ends), so a trace holds whole iterations: all their forwards, backwards and
    steps, nothing of the iterations around them (but an evaluation or checkpoint that falls
    inside the window)."""

    def __init__(self, config: LoggingConfig, rank: int, device_type: str):
        self.enabled = config.profile and rank in config.profile_ranks
        self.rank = rank
        self.start, self.end = config.profile_step_start, config.profile_step_end
        self.directory = (config.tensorboard_dir or os.path.dirname(config.log_file or "")
                          or os.getcwd())
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = None
        self._first = 0  # the first profiled batch (later than start when resumed in the window)

    def begin_segment(self, first_batch: int) -> None:
        if self.enabled and self._profiler is None and self.start <= first_batch < self.end:
            self._profiler = torch.profiler.profile(activities=self.activities,
                                                    record_shapes=True)
            self._profiler.start()
            self._first = first_batch

    def end_segment(self, completed: int) -> None:
        if completed >= self.end:
            self.finish(completed)

    def finish(self, completed: int) -> None:
        """Stop and write the trace; also called after the last segment, for a run that ends
        (--train-iters, an exit request) inside the window."""
        if self._profiler is None:
            return
        self._profiler.stop()
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(os.path.abspath(self.directory),
                            f"profile_rank{self.rank}_iter{self._first}-{completed}.pt.trace.json")
        self._profiler.export_chrome_trace(path)
        self._profiler = None
        print(f" [rank {self.rank}] profile of iterations [{self._first}, {completed}) (the log's "
              f"{self._first + 1} to {completed}) written to {path}", flush=True)


def _as_markdown_code(text: str) -> str:
    # TensorBoard renders text as markdown; indenting keeps JSON and tables verbatim.
    return "\n".join("    " + line for line in text.splitlines())


def format_log_line(iteration: int, train_iters: int, metrics: dict[str, float],
                    elapsed_s: float) -> str:
    """Megatron-style progress line. `elapsed_s` is the mean wall time of one iteration (seconds)
    over the last log interval; it gives the time per iteration and the ETA. Only metrics present
    in `metrics` are shown."""
    width = len(str(train_iters)) + 1
    fields = [f" iteration {iteration:{width}d}/{train_iters:{width}d}"]
    if "consumed-samples" in metrics:
        fields.append(f"consumed samples: {int(metrics['consumed-samples']):12d}")
    fields.append(f"elapsed time per iteration (ms): {elapsed_s * 1000:.1f}")
    if "learning-rate" in metrics:
        fields.append(f"learning rate: {metrics['learning-rate']:.3E}")
    if "global-batch-size" in metrics:
        fields.append(f"global batch size: {int(metrics['global-batch-size']):5d}")
    for key, value in metrics.items():
        if key.endswith("loss"):  # "lm loss", "sop loss", ...
            fields.append(f"{key}: {value:.6E}")
    if "loss-scale" in metrics:
        fields.append(f"loss scale: {metrics['loss-scale']:.1f}")
    if "grad-norm" in metrics:
        fields.append(f"grad norm: {metrics['grad-norm']:.3f}")
    if "num-zeros" in metrics:
        fields.append(f"num zeros: {int(metrics['num-zeros'])}")
    if "params-norm" in metrics:
        fields.append(f"params norm: {metrics['params-norm']:.3f}")
    if "skipped-iterations" in metrics:
        fields.append(f"skipped iterations: {int(metrics['skipped-iterations'])}")
    if "tokens-per-sec" in metrics:
        fields.append(f"tokens/s: {metrics['tokens-per-sec']:.0f}")
    if "tflops" in metrics:
        fields.append(f"TFLOP/s: {metrics['tflops']:.3g}")  # per GPU; tiny CPU runs stay readable
    if "mem-peak-bytes" in metrics:
        fields.append(f"mem: {metrics['mem-peak-bytes'] / 2**20:.1f} MiB")
    if "bubble-fraction" in metrics:
        fields.append(f"bubble: {100 * metrics['bubble-fraction']:.1f}%")
    remaining_s = max(0, train_iters - iteration) * elapsed_s
    fields.append(f"ETA {datetime.timedelta(seconds=round(remaining_s))}")
    return " | ".join(fields)
