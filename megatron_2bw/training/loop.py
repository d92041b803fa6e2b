"""The training loop: start up, build the stage, run the schedule segment by segment, evaluate,
log, save, stop."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.arguments import explicit_fields, parse_config
from megatron_2bw.batch_schedule import batch_schedule
from megatron_2bw.config import Config
from megatron_2bw.distributed.comm import all_reduce
from megatron_2bw.logging import IterationProfiler, Timers
from megatron_2bw.pipeline.update import StepResult
from megatron_2bw.training.exit_request import ExitRequest
from megatron_2bw.training.failures import FAILURE_CONTEXT
from megatron_2bw.training.housekeeping import MemoryHousekeeping
from megatron_2bw.training.progress import ProgressLog, print_rank0, timers_across_ranks
from megatron_2bw.training.segments import (MicrobatchFeed, microbatches_of, run_segment,
                                            segment_ends)
from megatron_2bw.training.stage import Stage, build_stage, startup_memory_report, static_tensors
from megatron_2bw.training.startup import build_checked_tokenizer, build_data, check_inputs, setup


SPLIT_LOG_NAMES = {"validation": "valid", "test": "test"}  # sink keys: valid/lm loss, test/lm loss


def evaluate(stage: Stage, iterator, log: ProgressLog, iteration: int,
             split: str = "validation") -> dict:
    """--eval-iters global batches of `iterator` forward-only with the newest weights; logs and
    returns the losses (on the last stage; an empty dict elsewhere)."""
    config = stage.config
    microbatches = stage.microbatches * config.training.eval_iters
    feed = MicrobatchFeed(iterator, stage.device, 0)
    sums, weight = stage.executor.evaluate(microbatches, feed)
    if split == "validation":  # the stream goes on from here at the next evaluation, or resume
        stage.consumed_valid_samples += microbatches * config.training.micro_batch_size * \
            stage.layout.data_replicas
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


def pretrain(config: Config, typed: set = frozenset()) -> Stage:
    """Train to --train-iters (or an exit request); returns this rank's stage. `typed`: the
    (section, field) pairs given on the command line, which --auto-parallel keeps pinned."""
    from megatron_2bw.checkpoint.ownership import claim_save_directory
    from megatron_2bw.checkpoint.save_load import adopt_checkpoint_layout
    check_inputs(config)
    tokenizer = build_checked_tokenizer(config)
    config.model.vocab_size = tokenizer.vocab_size  # before --auto-parallel profiles the model
    typed, adopted = adopt_checkpoint_layout(config, typed)
    config, layout, device, plan = setup(config, typed)
    if adopted:
        print_rank0(layout, f" --load {config.checkpoint.load}: continuing with the checkpoint's "
                            f"{' '.join(adopted)} (flags set otherwise win)")
    FAILURE_CONTEXT["layout"] = layout
    save_lock = claim_save_directory(config, layout, device)  # before the first write to --save
    try:
        return train_and_evaluate(config, layout, device, plan, tokenizer)
    finally:
        if save_lock is not None:
            save_lock.release()


def train_and_evaluate(config: Config, layout, device: torch.device, plan, tokenizer) -> Stage:
    """pretrain() once the processes are up: build the stage, load, train, evaluate, save."""
    from megatron_2bw.checkpoint import maybe_load_checkpoint, save_checkpoint
    from megatron_2bw.tensor_parallel.random import load_rng_state_dict
    synchronize = torch.cuda.synchronize if device.type == "cuda" else None
    timers = Timers(config.logging.timing_log_level, synchronize)
    log = ProgressLog(config, layout, timers, 0)
    log.timers_across_ranks = timers_across_ranks(config, log.is_writer)
    housekeeping = MemoryHousekeeping(config.training, device)

    def end_of_iteration(result: StepResult) -> None:
        log(result)
        housekeeping.after_step(result.batch + 1)

    stage = build_stage(config, layout, device, timers, on_step=end_of_iteration)
    FAILURE_CONTEXT["stage"] = stage
    log.memory = stage.memory
    resumed_rng = maybe_load_checkpoint(stage)
    check_iterations_left(config, layout, stage.iteration)
    train = config.training
    # the samples read before this run's first iteration, as the checkpoint counted them, over
    # the schedule's count: nonzero when a resumed run has another --global-batch-size, whose
    # data then continue where the checkpoint's stopped (Megatron-LM's consumed_train_samples)
    log.consumed_offset = stage.consumed_samples - batch_schedule(train).consumed(stage.iteration)
    log.start_iteration = log.last_logged = stage.iteration
    stage.memory.set_static(static_tensors(stage))
    print_rank0(layout, startup_summary(stage))
    if layout.coords.dp == 0:  # one line per model-parallel rank, as Megatron's memory report
        print(startup_memory_report(stage), flush=True)
    train_data, valid_data, test_data = build_data(
        config, layout, tokenizer, log.consumed_offset, stage.consumed_valid_samples)
    train_iterator = None if train.skip_train else train_data(stage.consumed_samples)
    # --skip-train evaluates the weights on the validation set from its start
    valid_start = 0 if train.skip_train else stage.consumed_valid_samples
    valid_iterator = valid_data(valid_start) if valid_data is not None else None
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
            stage.consumed_samples = batch_schedule(train).consumed(end) + log.consumed_offset
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
                FAILURE_CONTEXT["stage"] = stage
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


def check_iterations_left(config: Config, layout, iteration: int) -> None:
    """A resumed run with no iteration left to train says so; one whose --train-iters is below
    the checkpoint's iteration is refused (it would train nothing and exit 0). The same on every
    rank: all loaded the same iteration."""
    from megatron_2bw.checkpoint.save_load import CheckpointError
    train, root = config.training, config.checkpoint.load
    flag = "--train-samples" if train.train_samples else "--train-iters"
    if train.skip_train or iteration < train.train_iters:
        return
    if iteration > train.train_iters:
        raise CheckpointError(f"{flag} gives {train.train_iters} iterations, below the iteration "
                              f"of the --load {root} checkpoint ({iteration}): nothing to train; "
                              f"pass more to continue it")
    print_rank0(layout, f" --load {root} is at iteration {iteration}, the last of {flag}: "
                        f"nothing left to train")


def startup_summary(stage: Stage) -> str:
    c, layout, versions = stage.config, stage.layout, stage.versions
    held = sum(versions.layout.numels)  # every parameter of the rank's shard, in working copies
    owned = ""
    if versions.sharded:  # the distributed optimizer: its part of the master weights and state
        owned = (f" and owns {sum(m.numel() for m in versions.master) / 1e6:.2f} M of their "
                 f"master weights and optimizer state (1/{versions.layout.shards})")
    first = microbatches_of(stage, 0)
    ramp = f" (first {first}: the batch size changes)" if first != stage.microbatches else ""
    context = f" x cp {layout.context}" if layout.context > 1 else ""
    return (f" megatron_2bw: world {layout.world_size} = t {layout.tensor} x d "
            f"{layout.data_replicas}{context} x p {layout.pipeline}, "
            f"schedule {c.parallel.pipeline_schedule}, m = {stage.microbatches} "
            f"microbatches of {c.training.micro_batch_size}{ramp}, "
            f"{c.precision.working_dtype_name}; "
            f"stage 0 holds {held / 1e6:.2f} M parameters on rank 0{owned}")


def main(model_type: str, description: str = "") -> None:
    """The pretraining scripts: Megatron flags -> config -> pretrain."""
    config, args = parse_config(model_type=model_type, description=description)
    if config.checkpoint.use_checkpoint_args:
        from megatron_2bw.checkpoint.tool_config import with_checkpoint_model
        config = with_checkpoint_model(args, config)
    pretrain(config, explicit_fields(args))
