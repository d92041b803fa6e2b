"""The training loop: build the stage, run the schedule segment by segment, evaluate, log, save.

Training is cut into segments at evaluation, checkpoint and exit points; a segment runs its batches
as one schedule (2BW: one never-drained 1F1B sequence) and ends drained, which is where evaluation,
checkpointing and exit decisions (collectives over all ranks) are safe.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_2bw.arguments import explicit_fields, parse_config, validate_for_world
from megatron_2bw.batch_schedule import batch_schedule
from megatron_2bw.config import Config, ConfigError, TrainingConfig
from megatron_2bw.cpu_threads import busy_machine_note, set_single_process_threads
from megatron_2bw.distributed.comm import all_reduce
from megatron_2bw.distributed.error_file import record_failure
from megatron_2bw.distributed.launch import (exit_process, init_distributed, local_world_size,
                                              usable_cores)
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.distributed.p2p import PipelineP2P
from megatron_2bw.logging import (IterationProfiler, Timers, TimersAcrossRanks, TrainingLogger,
                                  format_log_line, measured_bubble_fraction)
from megatron_2bw.memory import MemoryTracker, optimizer_state_tensors, static_breakdown
from megatron_2bw.models import build_stage_model
from megatron_2bw.optim.grad_scaler import build_loss_scaler
from megatron_2bw.optim.lr_schedule import apply_schedule
from megatron_2bw.optim.optimizer import build_torch_optimizer
from megatron_2bw.planner.memory import estimate_stage_memory
from megatron_2bw.pipeline.executor import StageExecutor
from megatron_2bw.pipeline.partition import chunk_recompute, layer_ranges, stage_recompute
from megatron_2bw.pipeline.compensation import build_delay_compensation
from megatron_2bw.pipeline.pipemare import PipeMareWeights
from megatron_2bw.pipeline.schedules import VersionRule, stage_actions, stage_receives
from megatron_2bw.pipeline.update import GradientUpdater, StepResult
from megatron_2bw.pipeline.weights import WeightVersions
from megatron_2bw.tensor_parallel.random import seed_everything

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class AppliedSteps:
    """The learning-rate and weight-decay schedules advance on applied steps only, as Megatron-LM
    steps its OptimizerParamScheduler only after a successful update: a step skipped for an fp16
    overflow leaves them where they were. Checkpoints keep the count of skipped steps."""
    skipped: int = 0

    def schedule(self, config: Config):
        """The updater's `schedule(param_groups, batch)`."""
        return lambda groups, batch: apply_schedule(groups, batch - self.skipped, config.optimizer,
                                                    config.training)

    def counting(self, on_step):
        """on_step, counting the skipped steps first (the next step's rate depends on them)."""
        def counted(result: StepResult) -> None:
            self.skipped += bool(result.skipped)
            if on_step is not None:
                on_step(result)
        return counted


@dataclass
class Stage:
    """Everything one rank holds for its pipeline stage."""
    config: Config
    layout: ParallelLayout
    device: torch.device
    model: torch.nn.Module
    versions: WeightVersions
    optimizer: torch.optim.Optimizer
    scaler: object
    updater: GradientUpdater
    executor: StageExecutor
    memory: MemoryTracker
    timers: Timers
    microbatches: int
    iteration: int = 0  # batches completed (and stepped)
    consumed_samples: int = 0
    step_results: list = field(default_factory=list)
    applied_steps: AppliedSteps = field(default_factory=AppliedSteps)


def working_dtype(config: Config) -> torch.dtype:
    return DTYPES[config.precision.working_dtype_name]


def grad_dtype(config: Config) -> torch.dtype:
    dtype = working_dtype(config)
    return torch.float32 if config.precision.fp32_gradients else dtype


def build_stage(config: Config, layout: ParallelLayout, device: torch.device, timers: Timers,
                on_step=None) -> Stage:
    par, stage = config.parallel, layout.stage
    seed_everything(config.training.seed, layout.coords.tp, stage)
    if par.model_chunks > 1:
        model = build_model_chunks(config, layout).to(device)
    else:
        ranges = layer_ranges(config.model.num_layers, par.pipeline_parallel, par.layer_split)
        model = build_stage_model(config.model, layout.group("tensor"), par.tensor_parallel,
                                  ranges[stage], layout.is_first_stage, layout.is_last_stage,
                                  config.training.seed, stage_recompute(config.recompute, stage),
                                  layout.group("context"), device)
    if config.training.torch_compile:
        from megatron_2bw.models.compile import compile_transformer_layers
        compile_transformer_layers(model)
    rule = VersionRule(par.pipeline_schedule, par.pipeline_parallel, stage)
    sharded = par.use_distributed_optimizer and layout.data > 1  # build_optimizer's test
    versions = WeightVersions(model, working_dtype(config), grad_dtype(config), rule=rule,
                              predicted_versions=par.delay_compensation == "predict",
                              bucket_elements=par.ddp_bucket_size if sharded else None)
    optimizer = build_optimizer(config, versions.master, versions.names, layout)
    scaler = build_loss_scaler(config.precision)
    train = config.training
    applied_steps = AppliedSteps()
    updater = GradientUpdater(
        versions, optimizer, scaler, applied_steps.schedule(config), config.optimizer,
        layout.group("data"), layout.group("embedding"),
        # the ranks that decide a step together (norm, overflow): the stage alone under PipeDream
        layout.group("model") if rule.global_step_decisions else layout.group("tensor"),
        layout.group("tensor"), par.ddp_bucket_size, timers,
        check_for_nan=train.check_for_nan_in_loss_and_grad,
        log_params_norm=config.logging.log_params_norm,
        log_num_zeros_in_grad=config.logging.log_num_zeros_in_grad,
        per_token_loss=train.calculate_per_token_loss,
        overlap_grad_reduce=par.overlap_grad_reduce if par.overlap_grad_reduce is not None
        else device.type == "cuda",
        # the global norm's sharded sums: every rank (data x model) in one all-reduce
        sharded_norm_group=dist.group.WORLD if sharded and rule.global_step_decisions
        and layout.world_size == dist.get_world_size() else None)
    updater.compensation = build_delay_compensation(versions, par.delay_compensation,
                                                    par.delay_compensation_lambda)
    microbatches = train.global_batch_size // (train.micro_batch_size * layout.data_replicas)
    if par.pipeline_schedule == "pipemare":
        updater.pipemare = PipeMareWeights(versions, microbatches, stage, par.pipeline_parallel,
                                           par.pipemare_lr_warmup_iters,
                                           par.pipemare_discrepancy_decay)
    p2p = None
    if par.pipeline_parallel > 1:
        prev_rank = layout.stage_rank(stage - 1) if stage > 0 else None
        next_rank = layout.stage_rank(stage + 1) if not layout.is_last_stage else None
        if par.model_chunks > 1:  # the virtual pipeline wraps from the last rank to the first
            p = par.pipeline_parallel
            prev_rank, next_rank = layout.stage_rank((stage - 1) % p), layout.stage_rank(
                (stage + 1) % p)
        m = config.model
        shape = (train.micro_batch_size,
                 m.seq_length // (m.sequence_ranks(par.tensor_parallel) * layout.context),
                 m.hidden_size)
        p2p = PipelineP2P(prev_rank, next_rank, layout.group("pipeline"), shape,
                          working_dtype(config), device)
    memory = MemoryTracker(device)
    executor = StageExecutor(model, versions, updater, p2p, stage, par.pipeline_parallel,
                             microbatches, timers, memory, applied_steps.counting(on_step))
    executor.pipemare = updater.pipemare
    return Stage(config, layout, device, model, versions, optimizer, scaler, updater, executor,
                 memory, timers, microbatches, applied_steps=applied_steps)


def build_model_chunks(config: Config, layout: ParallelLayout):
    """Interleaved: the rank's v chunks, chunk c holding virtual stage c * p + stage's layers."""
    from megatron_2bw.models.chunks import ModelChunks
    par = config.parallel
    p, v = par.pipeline_parallel, par.model_chunks
    ranges = layer_ranges(config.model.num_layers, p * v)
    mine = [ranges[c * p + layout.stage] for c in range(v)]
    recompute = chunk_recompute(config.recompute, layout.stage, [len(r) for r in mine])
    return ModelChunks([
        build_stage_model(config.model, layout.group("tensor"), par.tensor_parallel,
                          mine[c], c == 0 and layout.is_first_stage,
                          c == v - 1 and layout.is_last_stage, config.training.seed,
                          recompute[c], layout.group("context"))
        for c in range(v)])


def build_optimizer(config: Config, master_params, names: list[str], layout: ParallelLayout):
    if config.parallel.use_distributed_optimizer and layout.data > 1:
        from megatron_2bw.optim.distributed import build_distributed_optimizer
        return build_distributed_optimizer(master_params, config.optimizer, layout.group("data"),
                                           names)
    return build_torch_optimizer(master_params, config.optimizer, names)


def static_tensors(stage: Stage) -> list[torch.Tensor]:
    """Weights, gradient buffers and optimizer state (all allocated when the stage is built)."""
    return stage.versions.tensors() + optimizer_state_tensors(stage.optimizer) + \
        compensation_tensors(stage) + pipemare_tensors(stage)


def compensation_tensors(stage: Stage) -> list[torch.Tensor]:
    """--delay-compensation's state (per-shard fp32, like the optimizer's)."""
    compensation = stage.updater.compensation
    return compensation.tensors() if compensation is not None else []


def pipemare_tensors(stage: Stage) -> list[torch.Tensor]:
    """PipeMare's T2 delta (weight-sized, fp32): what it holds in place of a version stash."""
    pipemare = stage.updater.pipemare
    return pipemare.tensors() if pipemare is not None else []


def startup_memory_report(stage: Stage) -> str:
    """This rank's memory by kind: the planner's estimate (the same estimator its search uses) and
    what the built stage holds (weights, gradients and optimizer state exist from the start)."""
    c, layout = stage.config, stage.layout
    # under context parallelism a rank's activations are those of its part of the sequence (the
    # gathered keys and values, which are whole, left out)
    model = replace(c.model, seq_length=c.model.seq_length // layout.context)
    estimate = estimate_stage_memory(model, c.parallel, c.precision, c.recompute,
                                     c.optimizer.optimizer, c.training.micro_batch_size,
                                     stage.microbatches, layout.data, layout.stage)
    measured = static_breakdown(stage.versions, stage.optimizer, compensation_tensors(stage),
                                pipemare_tensors(stage))
    mib = 2.0 ** 20
    names = {"params": "params", "grads": "grads", "optimizer": "optimizer state",
             "versions_stash": "version stash", "activations": "activations", "workspace": "workspace"}
    estimated = " | ".join(f"{label} {getattr(estimate, key) / mib:.2f}"
                           for key, label in names.items())
    held = " | ".join(f"{names[key]} {value / mib:.2f}" for key, value in measured.items())
    return (f" [rank {layout.rank}] stage {layout.stage} memory (MiB): estimated {estimated} | "
            f"total {estimate.total / mib:.2f}; held at start {held}")


# -- one segment ---------------------------------------------------------------------------------

class MicrobatchFeed:
    """Hands the executor microbatch k (forwards come in increasing k on every stage)."""

    def __init__(self, iterator, device: torch.device, first_microbatch: int):
        self.iterator, self.device, self.expected = iterator, device, first_microbatch

    def __call__(self, k: int) -> dict:
        if k != self.expected:
            raise RuntimeError(f"microbatch {k} requested, {self.expected} expected")
        self.expected += 1
        batch = next(self.iterator)
        return {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}


def microbatches_of(stage: Stage, batch: int) -> int:
    """m of `batch`: its global batch (batch_schedule.py) over micro x d."""
    train = stage.config.training
    return batch_schedule(train).global_batch(batch) // (train.micro_batch_size *
                                                         stage.layout.data_replicas)


def run_segment(stage: Stage, first_batch: int, batches: int, feed: MicrobatchFeed) -> None:
    """Batches first_batch.. of one size (segment_ends cuts at every change of the batch size)."""
    par = stage.config.parallel
    m = stage.executor.m = microbatches_of(stage, first_batch)
    actions = stage_actions(par.pipeline_schedule, par.pipeline_parallel, m, batches,
                            stage.layout.stage, first_batch, par.model_chunks)
    stage.executor.run(actions, feed, stage_receives(par.pipeline_parallel, m, batches,
                                                     stage.layout.stage, par.model_chunks))


def segment_ends(config: Config, start: int) -> list[int]:
    """Iterations after which the pipeline drains (evaluation, checkpoint, exit checks,
    repartitioning, the bounds of --profile's window, changes of the batch size, the end)."""
    train, ckpt, logs = config.training, config.checkpoint, config.logging
    if train.skip_train:
        return []
    intervals = [train.eval_interval] if train.eval_iters else []  # --eval-iters 0: no validation
    if ckpt.save and ckpt.save_interval:
        intervals.append(ckpt.save_interval)
    if train.exit_interval:
        intervals.append(train.exit_interval)
    if config.parallel.repartition_interval:  # layers move between stages only when drained
        intervals.append(config.parallel.repartition_interval)
    if train.exit_signal_handler or train.exit_duration_in_mins:
        intervals.append(train.log_interval)  # bounded reaction time to SIGTERM / the time limit
    ends = {train.train_iters, *batch_schedule(train).changes()}
    for interval in intervals:
        ends.update(range(interval, train.train_iters, interval))
    if logs.profile:  # the trace then holds whole iterations (IterationProfiler)
        ends.update(b for b in (logs.profile_step_start, logs.profile_step_end)
                    if b < train.train_iters)
    return sorted(e for e in ends if start < e <= train.train_iters)


# -- logging -------------------------------------------------------------------------------------

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
            "consumed-samples": batches.consumed(iteration),
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


def print_writer(log: ProgressLog, message: str) -> None:
    if log.is_writer:
        print(message, flush=True)


# -- the whole run -------------------------------------------------------------------------------

# the terminal's Ctrl-C reaches every process of the job and torchrun forwards its own to the
# workers: interrupts this close together are one Ctrl-C
SAME_INTERRUPT_S = 2.0


class ExitRequest:
    """SIGTERM (with --exit-signal-handler), Ctrl-C (SIGINT) or the time limit: save and stop at
    the next drain. A second Ctrl-C aborts at once, without a checkpoint."""

    def __init__(self, config: Config, start_time: float, announce: bool = False,
                 clock=time.monotonic):
        self.signalled = False
        self.deadline = None
        self.announce = announce  # this rank prints the one line an interrupt gets
        self.next_drain: int | None = None  # the iteration of the next drain (set by the loop)
        self.interrupted_at: float | None = None
        self._clock = clock
        if config.training.exit_duration_in_mins:
            self.deadline = start_time + 60 * config.training.exit_duration_in_mins
        # restored when training ends (pretrain() called from a program or a test keeps its own)
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        if config.training.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._handler)
        signal.signal(signal.SIGINT, self._interrupt)

    def __enter__(self) -> "ExitRequest":
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame):
        self.signalled = True

    def _say(self, text: str) -> None:
        if self.announce:  # os.write: print() may be mid-write when the signal arrives
            os.write(sys.stderr.fileno(), f"{text}\n".encode())

    def _interrupt(self, signum, frame):
        now = self._clock()
        if self.interrupted_at is None:
            self.interrupted_at, self.signalled = now, True
            where = f"iteration {self.next_drain}" if self.next_drain else "the next drain"
            self._say(f" interrupted (Ctrl-C): stopping at {where} (the next drain point), after "
                      f"saving a checkpoint where --save is set; Ctrl-C again to abort at once")
            # torchrun answers a second Ctrl-C of its own with SIGTERM to the workers
            signal.signal(signal.SIGTERM, self._abort)
        elif now - self.interrupted_at > SAME_INTERRUPT_S:
            self._abort(signum, frame)

    def _abort(self, signum, frame):
        self._say(" interrupted again: aborting without a checkpoint")
        sys.stdout.flush()
        os._exit(INTERRUPTED_EXIT_CODE)

    def agreed(self, device) -> bool:
        """Collective: every rank learns whether any rank wants to stop."""
        wanted = self.signalled or (self.deadline is not None and time.time() > self.deadline)
        flag = torch.tensor([1.0 if wanted else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


class MemoryHousekeeping:
    """--manual-gc and --empty-unused-memory-level: Python's collector and CUDA's cache are
    emptied at fixed points of the schedule, the same on every rank. Python collects whenever its
    allocation counts pass a threshold, at a different moment on each rank, and a rank stalled by
    a collection stalls the pipeline (Megatron-LM's reason for --manual-gc)."""

    def __init__(self, training: TrainingConfig, device: torch.device):
        self.training = training
        self.empty_cache_level = training.empty_unused_memory_level if device.type == "cuda" else 0

    @contextmanager
    def during_training(self):
        """With --manual-gc the collector is off (after one full collection) until training ends."""
        if not self.training.manual_gc:
            yield
            return
        gc.disable()
        gc.collect()
        try:
            yield
        finally:
            gc.enable()

    def after_step(self, iteration: int) -> None:
        interval = self.training.manual_gc_interval
        if self.training.manual_gc and interval and iteration % interval == 0:
            gc.collect()
        if self.empty_cache_level >= 1:
            torch.cuda.empty_cache()

    @contextmanager
    def around_evaluation(self):
        collect = self.training.manual_gc and self.training.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)  # what evaluation allocated, as Megatron-LM collects it
        if self.empty_cache_level >= 2:
            torch.cuda.empty_cache()


def set_cpu_threads(bound: bool) -> None:
    """Threads per rank: its bound cores, or else its share of the node's cores (torch would start
    a thread per core in every rank); a process alone (fine-tuning, a one-process run) leaves out
    the cores other processes keep busy."""
    if torch.cuda.is_available():
        return
    if not bound and local_world_size() == 1:
        set_single_process_threads()
        return
    cores = len(usable_cores())
    torch.set_num_threads(cores if bound else max(1, cores // local_world_size()))


def use_deterministic_algorithms() -> None:
    """--deterministic-mode: torch raises on an operation without a deterministic implementation.
    cuBLAS is deterministic only with a fixed workspace, which torch then insists on (CUDA >= 10.2)
    and cuBLAS reads from the environment when CUDA starts, so this runs before the device is
    picked; a value the user set is kept. Without CUDA nothing reads the variable."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def setup(config: Config, typed: set) -> tuple[Config, ParallelLayout, torch.device, object]:
    """Initialise the processes, apply --auto-parallel's plan, check the layout, build the groups."""
    if config.training.deterministic_mode:
        use_deterministic_algorithms()
    info, device = init_distributed(config.parallel.distributed_backend,
                                    config.parallel.timeout_minutes,
                                    config.parallel.bind_cores_to_rank)
    set_cpu_threads(config.parallel.bind_cores_to_rank)
    plan = None
    if config.parallel.auto_parallel:
        from megatron_2bw.planner.auto import describe_plan, plan_job
        busy = busy_machine_note()  # before the ranks' own work loads the machine
        config, plan = plan_job(config, info.world_size, info.rank, typed)
        if info.rank == 0:
            print(f" auto-parallel plan: {describe_plan(plan)}", flush=True)
            if busy is not None:
                print(f" auto-parallel: {busy}", flush=True)
            if config.parallel.planner_hardware != "local":
                print(f" auto-parallel: planned for --planner-hardware "
                      f"{config.parallel.planner_hardware}; its predictions describe that "
                      f"hardware, not necessarily this machine", flush=True)
    par = config.parallel
    validate_for_world(config, info.world_size)
    layout = ParallelLayout(info.world_size, par.tensor_parallel, par.pipeline_parallel, info.rank,
                            par.context_parallel)
    layout.build_groups(par.timeout_minutes)
    return config, layout, device, plan


SPLIT_LOG_NAMES = {"validation": "valid", "test": "test"}  # sink keys: valid/lm loss, test/lm loss


def evaluate(stage: Stage, iterator, log: ProgressLog, iteration: int,
             split: str = "validation") -> dict:
    """--eval-iters global batches of `iterator` forward-only with the newest weights; logs and
    returns the losses (on the last stage; an empty dict elsewhere)."""
    config = stage.config
    microbatches = stage.microbatches * config.training.eval_iters
    feed = MicrobatchFeed(iterator, stage.device, 0)
    sums, weight = stage.executor.evaluate(microbatches, feed)
    metrics = {}
    if stage.layout.is_last_stage and sums:
        values = torch.tensor([*sums.values(), weight], dtype=torch.float64, device=stage.device)
        all_reduce(values, stage.layout.group("data"))
        *totals, weight = values.tolist()
        metrics = {key: total / max(weight, 1.0) for key, total in zip(sums, totals)}
        if log.is_writer:
            text = " | ".join(f"{k}: {v:.6E} | {k} PPL: {_ppl(v):.6E}" for k, v in metrics.items())
            print(f" {split} at iteration {iteration} | {text}", flush=True)
            prefix = SPLIT_LOG_NAMES[split]
            record = {f"{prefix}/{k}": v for k, v in metrics.items()}
            if config.logging.log_validation_ppl_to_tensorboard:
                record.update({f"{prefix}/{k} ppl": _ppl(v) for k, v in metrics.items()})
            log.sink.log(iteration, record)
    return metrics


def _ppl(loss: float) -> float:
    return float(torch.tensor(min(loss, 20.0)).exp())


def report_memory(stage: Stage) -> None:
    """Gather every rank's measured peak (a drained point, so the collective is safe)."""
    peak = torch.tensor([float(stage.memory.peak_bytes())], dtype=torch.float64,
                        device=stage.device)  # NCCL gathers device tensors
    layout = stage.layout
    gathered = [torch.zeros_like(peak) for _ in range(layout.world_size)]
    if layout.world_size > 1:
        dist.all_gather(gathered, peak)
    else:
        gathered = [peak]
    if layout.rank == 0:
        per_stage = {}
        for rank, value in enumerate(gathered):
            per_stage.setdefault(layout.coordinates(rank).pp, []).append(value.item())
        text = ", ".join(f"stage {s}: {max(v) / 2**20:.1f} MiB" for s, v in sorted(per_stage.items()))
        print(f" measured peak memory per stage (max over its ranks): {text}", flush=True)


def build_data(config: Config, layout: ParallelLayout, tokenizer):
    """Train, validation and test iterator factories (consumed_samples -> iterator of
    microbatches; None for a split without data). Rank 0 builds the index caches first; the others
    then load them."""
    from megatron_2bw.data.builder import build_pretraining_datasets
    from megatron_2bw.data.samplers import build_data_iterator
    train = config.training
    evaluations = train.train_iters // train.eval_interval + 1
    counts = (batch_schedule(train).consumed(train.train_iters),
              evaluations * train.eval_iters * train.global_batch_size,
              train.eval_iters * train.global_batch_size)
    datasets = None
    for building_rank in (True, False):
        if (layout.rank == 0) == building_rank:
            datasets = build_pretraining_datasets(config, tokenizer, counts)
        if layout.world_size > 1:
            dist.barrier()

    def factory(dataset):
        if dataset is None:
            return None
        return lambda consumed: build_data_iterator(dataset, consumed, train.micro_batch_size,
                                                    layout.sample_rank, layout.data_replicas,
                                                    config.data.num_workers)
    return tuple(factory(dataset) for dataset in datasets)


def _check_writable(flag: str, path: str, directory: bool) -> None:
    """`path` can be written, or created: its nearest existing ancestor is a writable directory."""
    target = os.path.abspath(path)
    if os.path.islink(target) and not os.path.exists(target):
        raise ConfigError(f"{flag} {path}: a symbolic link to nothing")
    if os.path.exists(target):
        if os.path.isdir(target) != directory:
            raise ConfigError(f"{flag} {path}: exists and is {'not ' if directory else ''}a "
                              f"directory")
        if not os.access(target, os.W_OK):
            raise ConfigError(f"{flag} {path}: not writable")
        return
    ancestor = os.path.dirname(target)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot be created ({ancestor} is not a writable "
                          f"directory)")


def check_inputs(config: Config) -> None:
    """What the flags name on disk, checked on every rank before any process group or model
    exists, so that a mistake ends the job with one line naming the flag (ConfigError), not a
    traceback after start-up or an unwritable --save after the first interval of training."""
    from megatron_2bw.data.builder import check_data_flags
    check_data_flags(config.data)
    for flag, path, directory in (("--save", config.checkpoint.save, True),
                                  ("--tensorboard-dir", config.logging.tensorboard_dir, True),
                                  ("--log-file", config.logging.log_file, False)):
        if path:
            _check_writable(flag, path, directory)
    par = config.parallel
    if par.auto_parallel and par.planner_hardware != "local":
        from megatron_2bw.planner.hardware import load_hardware
        try:
            load_hardware(par.planner_hardware)
        except (ValueError, FileNotFoundError) as error:
            raise ConfigError(f"--planner-hardware: {error}") from None


def build_checked_tokenizer(config: Config):
    """The run's tokenizer; a tokenizer the flags cannot build, a BERT run's tokenizer without
    BERT's special tokens, or one without an end-of-document token where the GPT data flags need
    it, is a ConfigError naming the flags."""
    from megatron_2bw.data.bert_dataset import BertSpecialTokens
    from megatron_2bw.data.tokenizers import build_tokenizer
    kind = config.data.tokenizer_type
    try:
        tokenizer = build_tokenizer(config.data, config.model.vocab_size)
        if config.model.model_type == "bert" and not config.data.mock_data:
            BertSpecialTokens.from_tokenizer(tokenizer)  # BERT samples need [CLS], [SEP], ...
    except Exception as error:  # noqa: BLE001 - the tokenizer libraries raise plain Exception
        message = str(error).strip() or type(error).__name__
        raise ConfigError(message if message.startswith("--") or kind is None
                          else f"--tokenizer-type {kind}: {message}") from None
    if config.data.uses_document_boundaries and not tokenizer.has("eod"):
        raise ConfigError(f"--eod-mask-loss, --reset-position-ids and --reset-attention-mask need "
                          f"an end-of-document token, which {tokenizer.name} lacks "
                          f"(--tokenizer-type {kind})")
    return tokenizer


def pretrain(config: Config, typed: set = frozenset()) -> Stage:
    """Train to --train-iters (or an exit request); returns this rank's stage. `typed`: the
    (section, field) pairs given on the command line, which --auto-parallel keeps pinned."""
    from megatron_2bw.checkpoint import maybe_load_checkpoint, save_checkpoint
    from megatron_2bw.checkpoint.save_load import adopt_checkpoint_layout
    from megatron_2bw.tensor_parallel.random import load_rng_state_dict
    check_inputs(config)
    tokenizer = build_checked_tokenizer(config)
    config.model.vocab_size = tokenizer.vocab_size  # before --auto-parallel profiles the model
    typed, adopted = adopt_checkpoint_layout(config, typed)
    config, layout, device, plan = setup(config, typed)
    if adopted:
        print_rank0(layout, f" --load {config.checkpoint.load}: continuing with the checkpoint's "
                            f"{' '.join(adopted)} (flags set otherwise win)")
    _FAILURE_CONTEXT["layout"] = layout
    synchronize = torch.cuda.synchronize if device.type == "cuda" else None
    timers = Timers(config.logging.timing_log_level, synchronize)
    log = ProgressLog(config, layout, timers, 0)
    log.timers_across_ranks = timers_across_ranks(config, log.is_writer)
    housekeeping = MemoryHousekeeping(config.training, device)

    def end_of_iteration(result: StepResult) -> None:
        log(result)
        housekeeping.after_step(result.batch + 1)

    stage = build_stage(config, layout, device, timers, on_step=end_of_iteration)
    _FAILURE_CONTEXT["stage"] = stage
    log.memory = stage.memory
    resumed_rng = maybe_load_checkpoint(stage)
    log.start_iteration = log.last_logged = stage.iteration
    stage.memory.set_static(static_tensors(stage))
    print_rank0(layout, startup_summary(stage))
    if layout.coords.dp == 0:  # one line per model-parallel rank, as Megatron's memory report
        print(startup_memory_report(stage), flush=True)
    train_data, valid_data, test_data = build_data(config, layout, tokenizer)
    train = config.training
    train_iterator = None if train.skip_train else \
        train_data(batch_schedule(train).consumed(stage.iteration))
    valid_iterator = valid_data(0) if valid_data is not None else None
    if resumed_rng is not None:  # only now: creating the data loaders drew from the torch RNG
        load_rng_state_dict(resumed_rng)
    exit_request = ExitRequest(config, log.start_time, announce=layout.rank == 0)
    repartitioner = None
    if config.parallel.repartition_interval:
        from megatron_2bw.pipeline.repartition import Repartitioner
        repartitioner = Repartitioner(config, lambda line: print_rank0(layout, line))
        repartitioner.attach(stage)
    profiler = IterationProfiler(config.logging, layout.rank, device.type)
    if train.skip_train:
        print_rank0(layout, f" skipping training (--skip-train): evaluating the weights of "
                            f"iteration {stage.iteration}")
        if valid_iterator is not None:
            evaluate(stage, valid_iterator, log, stage.iteration)
    with housekeeping.during_training(), exit_request:
        for end in segment_ends(config, stage.iteration):
            exit_request.next_drain = end
            feed = MicrobatchFeed(train_iterator, device,
                                  stage.iteration * microbatches_of(stage, stage.iteration))
            profiler.begin_segment(stage.iteration)  # outside the log's interval time
            log.begin_segment()
            run_segment(stage, stage.iteration, end - stage.iteration, feed)
            log.end_segment()
            profiler.end_segment(end)
            stage.iteration = end
            stage.consumed_samples = batch_schedule(train).consumed(end)
            if valid_iterator is not None and (end % train.eval_interval == 0
                                               or end == train.train_iters):
                with housekeeping.around_evaluation():
                    evaluate(stage, valid_iterator, log, end)
            stopping = exit_request.agreed(device) or bool(
                train.exit_interval and end % train.exit_interval == 0)
            ckpt = config.checkpoint
            if ckpt.save and (stopping or end == train.train_iters
                              or (ckpt.save_interval and end % ckpt.save_interval == 0)):
                save_checkpoint(stage)
            if stopping:
                print_rank0(layout, f" exiting at iteration {end} (signal, time limit or "
                                    f"--exit-interval)")
                break
            if repartitioner is not None and end < train.train_iters and repartitioner.due(end):
                stage = repartitioner(stage, lambda c: build_stage(c, layout, device, timers,
                                                                   on_step=end_of_iteration))
                _FAILURE_CONTEXT["stage"] = stage
                log.memory = stage.memory
                stage.memory.set_static(static_tensors(stage))
    if test_data is not None and (train.skip_train or stage.iteration == train.train_iters):
        with housekeeping.around_evaluation():  # as Megatron-LM: once training is complete
            evaluate(stage, test_data(0), log, stage.iteration, split="test")
    profiler.finish(stage.iteration)
    if log.timers_across_ranks is not None:
        log.timers_across_ranks.finish()
    report_memory(stage)
    if plan is not None and log.is_writer and log.interval_throughputs:
        measured = sorted(log.interval_throughputs)[len(log.interval_throughputs) // 2]
        print(f" auto-parallel: planner predicted {plan.throughput_samples_per_s:.2f} samples/s, "
              f"measured {measured:.2f} samples/s (median of the log intervals after the first)",
              flush=True)
    log.sink.close()
    return stage


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


def startup_summary(stage: Stage) -> str:
    c, layout = stage.config, stage.layout
    n = sum(p.numel() for p in stage.versions.master)
    first = microbatches_of(stage, 0)
    ramp = f" (first {first}: the batch size changes)" if first != stage.microbatches else ""
    context = f" x cp {layout.context}" if layout.context > 1 else ""
    return (f" megatron_2bw: world {layout.world_size} = t {layout.tensor} x d "
            f"{layout.data_replicas}{context} x p {layout.pipeline}, schedule {c.parallel.pipeline_schedule}, m = {stage.microbatches} "
            f"microbatches of {c.training.micro_batch_size}{ramp}, "
            f"{c.precision.working_dtype_name}; "
            f"stage 0 holds {n / 1e6:.2f} M parameters on rank 0")


def main(model_type: str, description: str = "") -> None:
    """The pretraining scripts: Megatron flags -> config -> pretrain."""
    config, args = parse_config(model_type=model_type, description=description)
    if config.checkpoint.use_checkpoint_args:
        from megatron_2bw.checkpoint.tool_config import with_checkpoint_model
        config = with_checkpoint_model(args, config)
    pretrain(config, explicit_fields(args))


_FAILURE_CONTEXT: dict = {}


def run_and_report(main) -> None:
    """Run `main()`; on any failure print the rank's layout coordinates, stage and last schedule
    actions, then end this process at once (non-zero) so the launcher stops the whole job."""
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before training began (or in a tool): one line, no trace
        layout = _FAILURE_CONTEXT.get("layout")
        if (layout.rank if layout else int(os.environ.get("RANK", "0"))) == 0:
            print(f"{os.path.basename(sys.argv[0])}: interrupted", file=sys.stderr, flush=True)
        exit_process(INTERRUPTED_EXIT_CODE)
    except ConfigError as error:
        name = os.path.basename(sys.argv[0])
        layout = _FAILURE_CONTEXT.get("layout")
        if layout is None or layout.rank == 0:
            print(f"{name}: error: {error}", file=sys.stderr, flush=True)
        record_failure(f"{name}: error: {error}")
        exit_process(2)
    except BaseException as error:  # noqa: BLE001 - every failure must end the job loudly
        if isinstance(error, SystemExit) and not error.code:  # --help, a requested exit
            exit_process(0)
        layout = _FAILURE_CONTEXT.get("layout")
        stage = _FAILURE_CONTEXT.get("stage")
        where = layout.describe() if layout else f"rank {os.environ.get('RANK', '?')}"
        if layout is not None:
            where += f", stage {layout.stage}"
        history = stage.executor.describe_history() if stage else "(not started)"
        traceback.print_exc()
        failure = f"FAILED: {where}: {type(error).__name__}: {error}"
        print(f"{failure}\n  last schedule actions: {history}", file=sys.stderr, flush=True)
        record_failure(failure)
        exit_process(1)
    else:
        exit_process(0)
