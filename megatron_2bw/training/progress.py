"""Progress: the log line, the sinks (TensorBoard, W&B, the log file) and the throughput figures,
written by the rank that holds the loss."""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from megatron_2bw.batch_schedule import batch_schedule
from megatron_2bw.config import Config
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.logging import (Timers, TimersAcrossRanks, TrainingLogger, format_log_line,
                                  measured_bubble_fraction)
from megatron_2bw.memory import MemoryTracker
from megatron_2bw.pipeline.update import StepResult


def model_flops_per_sample(config: Config) -> float:
    """Analytic model FLOPs of one sample (forward + backward, x4/3 with full recomputation):
    per token and layer the four linears' (planner.profile.linear_flops_per_token: 24h^2 in
    GPT-2's layout) and the attention scores' and their product with V's
    (planner.profile.attention_flops_per_token: 4sh in GPT-2's layout); a per-stage recompute
    plan adds its recomputed layers' forwards."""
    from megatron_2bw.planner.profile import attention_flops_per_token, linear_flops_per_token
    m = config.model
    per_token_layer = linear_flops_per_token(m) + attention_flops_per_token(m)
    per_token = m.num_layers * per_token_layer + 2 * m.hidden_size * m.vocab_size
    factor = 4 if config.recompute.granularity == "full" else 3
    plan = config.recompute.num_layers_per_stage
    if plan is not None:  # the recomputed share of the layers repeats its forward
        factor = 3 + sum(plan) / m.num_layers
    return factor * m.seq_length * per_token


class ProgressLog:
    """Log lines, sinks and throughput on the rank that holds the loss (last stage, tp 0, dp 0)."""

    def __init__(self, config: Config, layout: ParallelLayout, timers: Timers, start_iteration: int):
        self.config, self.layout, self.timers = config, layout, timers
        self.is_writer = layout.rank == layout.rank_of(0, 0, layout.pipeline - 1)
        self.sink = TrainingLogger(config.logging, self.is_writer, config.to_dict())
        self.start_time = time.time()
        # an interval runs from the end of the last logged batch (StepResult.ended_at) to the end
        # of this one, without the time between segments (evaluation, checkpoints), as Megatron
        # stops its interval timer for them; the first begins with the first segment
        self.interval_start: float | None = None
        self.segment_end: float | None = None
        self.between_segments = 0.0  # seconds outside segments since interval_start
        self.start_iteration = self.last_logged = start_iteration
        # samples read beyond the batch schedule's count: a resumed run's whose checkpoint was
        # trained with other batch sizes (training/loop.py)
        self.consumed_offset = 0
        self.memory: MemoryTracker | None = None
        self.results: list[StepResult] = []
        self.interval_throughputs: list[float] = []  # samples/s per log interval
        self.timers_across_ranks: TimersAcrossRanks | None = None  # --timing-log-level >= 1

    def begin_segment(self) -> None:
        now = time.perf_counter()
        if self.interval_start is None:
            self.interval_start = now
        elif self.segment_end is not None:
            self.between_segments += now - self.segment_end

    def end_segment(self) -> None:
        self.segment_end = time.perf_counter()

    def __call__(self, result: StepResult) -> None:
        self.results.append(result)
        if self.timers_across_ranks is not None:
            self.timers_across_ranks.print_ready()
        iteration = result.batch + 1
        train = self.config.training
        values = iteration_values(result)
        # the sinks: every --tensorboard-log-interval iterations that iteration's own values (as
        # Megatron-LM writes TensorBoard), at log intervals also the interval's figures
        record = ({key: value for key, value in values.items() if value is not None}
                  if iteration % self.config.logging.tensorboard_log_interval == 0 else {})
        if iteration % train.log_interval and iteration != train.train_iters:
            self.sink.log(iteration, record)
            return
        iterations = iteration - self.last_logged
        elapsed = result.ended_at - self.interval_start - self.between_segments
        seconds = elapsed / max(iterations, 1)
        self.interval_start, self.between_segments = result.ended_at, 0.0
        batches = batch_schedule(train)
        # per iteration of the interval (whose batches can differ: batch_schedule.py)
        samples = (batches.consumed(iteration) - batches.consumed(self.last_logged)) / \
            max(iterations, 1)
        first_of_interval, self.last_logged = self.last_logged + 1, iteration
        metrics = {key: sum(r.metrics.get(key, 0.0) for r in self.results) / len(self.results)
                   for key in self.results[-1].metrics}
        finite = [r.grad_norm for r in self.results if not r.skipped]
        metrics.update({
            "learning-rate": result.learning_rate,
            "grad-norm": sum(finite) / len(finite) if finite else float("nan"),
            "loss-scale": result.loss_scale,
            "skipped-iterations": sum(r.skipped for r in self.results),
            "tokens-per-sec": samples * self.config.model.seq_length / seconds,
            "tflops": samples * model_flops_per_sample(self.config) / seconds
            / self.layout.world_size / 1e12,
            "time-per-iter-ms": seconds * 1000,
            "consumed-samples": batches.consumed(iteration) + self.consumed_offset,
            "global-batch-size": batches.global_batch(result.batch),
        })
        # the last step's, as Megatron logs them (--log-params-norm, --log-num-zeros-in-grad)
        metrics.update({key: values[key] for key in ("params-norm", "num-zeros")
                        if values[key] is not None})
        if self.memory is not None:
            metrics["mem-peak-bytes"] = self.memory.peak_bytes()
        timings = self.timers.summary(reset=True)
        per_iteration_ms = {name: value * 1000 / max(iterations, 1)
                            for name, value in timings.items()}
        metrics.update({f"timers/{name}-ms": ms for name, ms in per_iteration_ms.items()})
        if self.timers_across_ranks is not None:
            self.timers_across_ranks.submit(first_of_interval, iteration, per_iteration_ms)
        if "forward" in timings:
            metrics["bubble-fraction"] = measured_bubble_fraction(timings, seconds * iterations)
        self.results = []
        if iteration - iterations > self.start_iteration:  # the first one also warms up
            self.interval_throughputs.append(samples / seconds)
        if self.is_writer:
            print(format_log_line(iteration, train.train_iters, metrics, seconds), flush=True)
            self.sink.log(iteration, {**record, **self.interval_figures(metrics, values)})

    def interval_figures(self, metrics: dict, values: dict) -> dict:
        """What only the interval has (throughput, time, memory, skipped steps, ...): the values
        an iteration has of its own go to the sinks in the per-iteration records instead; the
        timers only with --log-timers-to-tensorboard, as in Megatron-LM."""
        with_timers = self.config.logging.log_timers_to_tensorboard
        return {key: value for key, value in metrics.items()
                if key not in values and (with_timers or not key.startswith("timers/"))}


def iteration_values(result: StepResult) -> dict:
    """One iteration's own values for the sinks; None where the iteration has none (a skipped
    step's gradient norm, the norms that are not asked for)."""
    return {**result.metrics, "learning-rate": result.learning_rate,
            "loss-scale": result.loss_scale,
            "grad-norm": None if result.skipped else result.grad_norm,
            "params-norm": result.params_norm, "num-zeros": result.num_zeros_in_grad}


def print_rank0(layout: ParallelLayout, message: str) -> None:
    if layout.rank == 0:
        print(message, flush=True)


def timers_across_ranks(config: Config, is_writer: bool) -> TimersAcrossRanks | None:
    """The timer report of --timing-log-level >= 1, on a gloo group of every rank (collective:
    every rank calls this)."""
    if config.logging.timing_log_level < 1:
        return None
    group = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.new_group(backend="gloo",
                               timeout=timedelta(minutes=config.parallel.timeout_minutes))
    return TimersAcrossRanks(group, is_writer)
