"""One rank's pipeline stage: its model part, weight versions, optimizer, updater, p2p and
executor, built from the config and the layout (and rebuilt by --repartition-interval)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from megatron_2bw.config import Config
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.distributed.p2p import PipelineP2P
from megatron_2bw.logging import Timers
from megatron_2bw.memory import MemoryTracker, optimizer_state_tensors, static_breakdown
from megatron_2bw.models import build_stage_model
from megatron_2bw.optim.grad_scaler import build_loss_scaler
from megatron_2bw.optim.lr_schedule import apply_schedule
from megatron_2bw.optim.optimizer import build_torch_optimizer
from megatron_2bw.pipeline.compensation import build_delay_compensation
from megatron_2bw.pipeline.executor import StageExecutor
from megatron_2bw.pipeline.partition import chunk_recompute, layer_ranges, stage_recompute
from megatron_2bw.pipeline.pipemare import PipeMareWeights
from megatron_2bw.pipeline.schedules import VersionRule
from megatron_2bw.pipeline.update import GradientUpdater, StepResult
from megatron_2bw.pipeline.weights import WeightVersions
from megatron_2bw.planner.memory import estimate_stage_memory
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
    consumed_samples: int = 0  # training samples read, as Megatron-LM's consumed_train_samples
    consumed_valid_samples: int = 0  # validation samples read (the stream continues on resume)
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
                                     stage.microbatches, layout.data, layout.stage,
                                     device_type=stage.device.type)
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
