"""Megatron-style checkpoints that lose nothing, written atomically.

Layout (one directory per saved iteration, one model file per model-parallel rank):
    SAVE/latest_checkpointed_iteration.txt                         written last, atomically
    SAVE/iter_0000100/metadata.json                                iteration, layout, configuration
    SAVE/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   (data-parallel rank 0)
    SAVE/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/rng_dp{dp:03d}.pt    (every rank: its RNG states)

A model file holds, by parameter name, the stage's fp32 master weights, every live working version
(2BW keeps two), the optimizer state and each parameter's ParamSpec (full shape, partition
dimension), plus the loss-scaler state, the configuration, the iteration and the consumed samples.
Naming everything by parameter (layers by their global index) is what lets tools reshard a
checkpoint or export it without knowing the layer classes.

Every file is written under a temporary name and renamed; the marker is written only after every
rank has written its files, so a crash during a save leaves the previous checkpoint as `latest`.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megatron_2bw.config import Config, ConfigError
from megatron_2bw.optim.lr_schedule import schedule_iterations, training_iterations
from megatron_2bw.pipeline.partition import layer_ranges
from megatron_2bw.tensor_parallel.random import rng_state_dict

FORMAT = "megatron_2bw/2"
MARKER = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
MODEL_FILE = "model_optim_rng.pt"
CONVERT_HINT = ("convert it with tools/convert_checkpoint.py --load {root} --save NEW_DIR "
                "--target-tensor-parallel-size {t} --target-pipeline-parallel-size {p}")
# Model fields that fix the parameters' shapes or what they compute: a checkpoint only loads into
# the same architecture. (head_dim, a property: --kv-channels equal to hidden / heads is no change.)
ARCHITECTURE_FIELDS = ("model_type", "num_layers", "hidden_size", "num_attention_heads",
                       "ffn_hidden_size", "max_position_embeddings", "vocab_size", "num_tokentypes",
                       "bert_binary_head", "untie_embeddings_and_output_weights", "normalization",
                       "add_bias_linear", "add_qkv_bias", "swiglu", "openai_gelu",
                       "position_embedding_type",
                       "rotary_percent", "rotary_base", "rotary_interleaved", "rope_scaling",
                       "rope_scaling_factor", "num_query_groups", "head_dim", "qk_layernorm",
                       "apply_layernorm_1p")
# the flag that sets a field, where it is not the field's name
ARCHITECTURE_FLAGS = {"add_bias_linear": "--disable-bias-linear", "head_dim": "--kv-channels",
                      "num_query_groups": "--group-query-attention --num-query-groups"}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked; the message names the directory and the fix."""


# -- paths and atomic files -------------------------------------------------------------------------

def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir(root: str, iteration: int, tp: int, pp: int) -> str:
    return os.path.join(iteration_dir(root, iteration), f"mp_rank_{tp:02d}_{pp:03d}")


def model_file(root: str, iteration: int, tp: int, pp: int) -> str:
    return os.path.join(rank_dir(root, iteration, tp, pp), MODEL_FILE)


def rng_file(root: str, iteration: int, tp: int, pp: int, dp: int) -> str:
    return os.path.join(rank_dir(root, iteration, tp, pp), f"rng_dp{dp:03d}.pt")


def _atomic_write(path: str, write) -> None:
    """write(tmp_path), fsync, rename over `path`; a failure leaves no partial file behind."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_save(obj, path: str) -> None:
    _atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_write_text(text: str, path: str) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    _atomic_write(path, write)


def write_marker(root: str, iteration: int) -> None:
    atomic_write_text(f"{iteration}\n", os.path.join(root, MARKER))


def read_marker(root: str) -> int | None:
    path = os.path.join(root, MARKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def resolve_iteration(root: str, iteration: int | None = None) -> int:
    """`iteration` if given (it must have been saved), else the latest one."""
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if iteration is None:
        iteration = read_marker(root)
        if iteration is None:
            raise CheckpointError(f"{root} holds no checkpoint: {MARKER} is missing")
    if not os.path.isfile(os.path.join(iteration_dir(root, iteration), METADATA_FILE)):
        raise CheckpointError(f"{root} has no complete checkpoint of iteration {iteration} "
                              f"({iteration_dir(root, iteration)}/{METADATA_FILE} is missing)")
    return iteration


def read_metadata(root: str, iteration: int | None = None) -> dict:
    """{"format", "iteration", "consumed_samples", "consumed_valid_samples", "layout": {tensor,
    pipeline, data}, "config"}."""
    iteration = resolve_iteration(root, iteration)
    with open(os.path.join(iteration_dir(root, iteration), METADATA_FILE)) as f:
        return json.load(f)


def saved_config(root: str, iteration: int | None = None) -> Config:
    return Config.from_dict(read_metadata(root, iteration)["config"])


def write_metadata(root: str, iteration: int, consumed_samples: int, config: Config,
                   tensor: int, pipeline: int, data: int, consumed_valid_samples: int = 0) -> None:
    metadata = {"format": FORMAT, "iteration": iteration, "consumed_samples": consumed_samples,
                "consumed_valid_samples": consumed_valid_samples,
                "layout": {"tensor": tensor, "pipeline": pipeline, "data": data},
                "config": config.to_dict()}
    atomic_write_text(json.dumps(metadata, indent=2) + "\n",
                      os.path.join(iteration_dir(root, iteration), METADATA_FILE))


def load_file(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - torch.load fails in many ways on a damaged file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CheckpointError(f"{path}: cannot be read ({type(error).__name__}: {reason}): the "
                              f"file is damaged or truncated") from None


# -- optimizer state by parameter name ----------------------------------------------------------------

def optimizer_state_by_name(optimizer, names_of: dict[int, str]) -> dict:
    """torch numbers parameters by position in the optimizer; a checkpoint names them, so it loads
    whatever the order and can be resharded. -> {"groups": [{..., "params": [names]}],
    "state": {name: {key: value}}}."""
    state = optimizer.state_dict()
    name_at = [names_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [name_at[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"groups": groups, "state": {name_at[i]: s for i, s in state["state"].items()}}


def optimizer_state_by_index(optimizer, saved: dict, names_of: dict[int, str]) -> dict:
    """The inverse, for this optimizer's own groups and order (hyper-parameters from the saved
    group holding the same parameters)."""
    saved_group_of = {name: g for g in saved["groups"] for name in g["params"]}
    groups, state, index = [], {}, 0
    for group in optimizer.param_groups:
        names = [names_of[id(p)] for p in group["params"]]
        source = saved_group_of.get(names[0], group) if names else group
        groups.append({**{k: v for k, v in source.items() if k != "params"},
                       "params": list(range(index, index + len(names)))})
        for name in names:
            if name in saved["state"]:
                state[index] = saved["state"][name]
            index += 1
    return {"state": state, "param_groups": groups}


# -- save --------------------------------------------------------------------------------------------

def spec_dict(spec) -> dict:
    return {"full_shape": list(spec.full_shape), "partition_dim": spec.partition_dim,
            "tied": spec.tied, "tied_copy": spec.tied_copy}


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its elements: torch.save writes a view's whole storage, which
    for a view into a flat buffer would be the buffer."""
    tensor = tensor.detach().cpu()
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.clone()


def stage_state(stage, master: list[torch.Tensor], compensation: dict | None = None) -> dict:
    """Data-parallel rank 0's file; `master` holds the full fp32 master weights, `compensation`
    the --delay-compensation state (pipeline/compensation.py), if any."""
    v = stage.versions
    v.wait_gathers()  # the distributed optimizer's newest version may still be arriving
    names_of = {id(m): name for name, m in zip(v.names, v.master)}
    versions = {} if v.alias else {
        version: {name: _standalone(t) for name, t in zip(v.names, leaves)}
        for version, leaves in v.versions.items()}
    c = stage.layout.coords
    return {
        "format": FORMAT,
        "iteration": stage.iteration,
        "consumed_samples": stage.consumed_samples,
        "consumed_valid_samples": stage.consumed_valid_samples,
        "config": stage.config.to_dict(),
        "layout": {"tensor": stage.layout.tensor, "pipeline": stage.layout.pipeline,
                   "data": stage.layout.data},
        "tp_rank": c.tp, "pp_rank": c.pp,
        "specs": {name: spec_dict(spec) for name, spec in zip(v.names, v.specs)},
        "model": {name: _standalone(m) for name, m in zip(v.names, master)},
        "versions": versions,
        "optimizer": optimizer_state_by_name(stage.optimizer, names_of),
        "loss_scaler": stage.scaler.state_dict(),
        "skipped_steps": stage.applied_steps.skipped,  # the schedules' position (AppliedSteps)
        "delay_compensation": compensation,
        # PipeMare's T2 delta (every data-parallel rank holds all of it)
        "pipemare": stage.updater.pipemare.state_dict() if stage.updater.pipemare else None,
    }


def _any_rank_failed(failed: bool, layout, device: torch.device) -> bool:
    if not (dist.is_initialized() and layout.world_size > 1):
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=device)  # NCCL reduces device tensors
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def save_checkpoint(stage) -> str:
    """Collective over all ranks, at a drained point. The marker moves to this iteration only after
    every rank has written its files."""
    root, layout = stage.config.checkpoint.save, stage.layout
    c = layout.coords
    writer = layout.rank_of(c.tp, 0, c.pp)  # data-parallel rank 0 writes the stage's file
    master = stage.versions.full_master(dst=writer)  # distributed optimizer: gathered there
    compensation = stage.updater.compensation
    compensation = compensation.full_state(dst=writer) if compensation is not None else None
    if hasattr(stage.optimizer, "consolidate_state_dict"):
        stage.optimizer.consolidate_state_dict(to=writer)
    error = None
    try:
        if c.dp == 0:
            atomic_save(stage_state(stage, master, compensation),
                        model_file(root, stage.iteration, c.tp, c.pp))
        atomic_save(rng_state_dict(), rng_file(root, stage.iteration, c.tp, c.pp, c.dp))
        if layout.rank == 0:
            write_metadata(root, stage.iteration, stage.consumed_samples, stage.config,
                           layout.tensor, layout.pipeline, layout.data,
                           stage.consumed_valid_samples)
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it before the marker
        error = caught
    if _any_rank_failed(error is not None, layout, stage.device):
        if error is not None:
            raise error
        raise CheckpointError(f"saving iteration {stage.iteration} to {root} failed on another "
                              f"rank; {MARKER} still names the previous checkpoint")
    if layout.rank == 0:
        write_marker(root, stage.iteration)
        print(f" saved checkpoint at iteration {stage.iteration} to {root}", flush=True)
    if dist.is_initialized() and layout.world_size > 1:
        dist.barrier()
    return rank_dir(root, stage.iteration, c.tp, c.pp)


# -- load --------------------------------------------------------------------------------------------

def _layers_per_stage(config: Config) -> list[int]:
    return [len(r) for r in layer_ranges(config.model.num_layers, config.parallel.pipeline_parallel,
                                         config.parallel.layer_split)]


def check_layout(metadata: dict, root: str, current: Config) -> None:
    saved = metadata["layout"]
    tensor, pipeline = current.parallel.tensor_parallel, current.parallel.pipeline_parallel
    if (saved["tensor"], saved["pipeline"]) != (tensor, pipeline):
        raise CheckpointError(
            f"checkpoint {root} (iteration {metadata['iteration']}) was saved with "
            f"--tensor-model-parallel-size {saved['tensor']} --pipeline-model-parallel-size "
            f"{saved['pipeline']}, but this run uses --tensor-model-parallel-size {tensor} "
            f"--pipeline-model-parallel-size {pipeline}; "
            + CONVERT_HINT.format(root=root, t=tensor, p=pipeline))
    saved_config = Config.from_dict(metadata["config"])
    chunks, current_chunks = saved_config.parallel.model_chunks, current.parallel.model_chunks
    if chunks != current_chunks:  # a rank's file holds the layers of its chunks
        raise CheckpointError(
            f"checkpoint {root} (iteration {metadata['iteration']}) was saved with {chunks} model "
            f"chunk(s) per pipeline rank (--virtual-pipeline-model-parallel-size), this run uses "
            f"{current_chunks}; " + CONVERT_HINT.format(root=root, t=tensor, p=pipeline)
            + f" --target-virtual-pipeline-model-parallel-size {current_chunks}")
    old, new = _layers_per_stage(saved_config), _layers_per_stage(current)
    if old != new:
        raise CheckpointError(
            f"checkpoint {root} (iteration {metadata['iteration']}) was saved with "
            f"--pipeline-layer-split {','.join(map(str, old))}, but this run splits the layers "
            f"{','.join(map(str, new))}: pass --pipeline-layer-split {','.join(map(str, old))}")


def check_architecture(saved: Config, current: Config, root: str) -> None:
    for field in ARCHITECTURE_FIELDS:
        old, new = getattr(saved.model, field), getattr(current.model, field)
        if old != new:
            flag = ARCHITECTURE_FLAGS.get(field, "--" + field.replace("_", "-"))
            raise CheckpointError(f"checkpoint {root} holds a model with {field} = {old!r}, this run "
                                  f"has {new!r} (set by {flag} or the tokenizer): the weights do not "
                                  f"fit")


# the learning-rate and weight-decay schedule a resumed run must agree on (Megatron-LM's
# OptimizerParamScheduler checks the same), as (flag, field of OptimizerConfig)
SCHEDULE_FLAGS = (("--lr", "lr"), ("--min-lr", "min_lr"), ("--lr-warmup-init", "lr_warmup_init"),
                  ("--lr-decay-style", "lr_decay_style"), ("--decoupled-lr", "decoupled_lr"),
                  ("--decoupled-min-lr", "decoupled_min_lr"), ("--weight-decay", "weight_decay"),
                  ("--start-weight-decay", "start_weight_decay"),
                  ("--end-weight-decay", "end_weight_decay"),
                  ("--weight-decay-incr-style", "weight_decay_incr_style"))


def _schedule(config: Config) -> dict[str, object]:
    """{flag: value} of the schedule, the warm-up and decay lengths as the steps they span."""
    opt, train = config.optimizer, config.training
    warmup, decay = schedule_iterations(opt, train)
    values = {flag: getattr(opt, name) for flag, name in SCHEDULE_FLAGS}
    values["--lr-warmup-iters (or -samples, -fraction)"] = warmup
    values["--lr-decay-iters (default --train-iters)"] = decay
    if opt.start_weight_decay != opt.end_weight_decay:  # the increment spans the training
        values["--train-iters (the weight-decay increment's span)"] = training_iterations(train)
    return values


def check_optimizer(saved: Config, current: Config, root: str) -> None:
    """An optimizer's state resumes only under the same rule (Muon's momentum buffer is not
    Adam's moments)."""
    was, now = saved.optimizer.optimizer, current.optimizer.optimizer
    if was != now:
        raise CheckpointError(f"checkpoint {root} holds the state of --optimizer {was}, this run "
                              f"uses --optimizer {now}: pass --optimizer {was}, or --no-load-optim "
                              f"to start a fresh optimizer from its weights")


def resolve_schedule(saved: Config, current: Config, root: str) -> None:
    """A resumed run continues the checkpoint's schedule. Where this run's flags give another,
    --override-opt_param-scheduler keeps the flags', --use-checkpoint-opt_param-scheduler takes
    the checkpoint's (into `current`), and without either the run is refused, as in Megatron-LM."""
    ckpt = current.checkpoint
    if ckpt.override_opt_param_scheduler and ckpt.use_checkpoint_opt_param_scheduler:
        raise CheckpointError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler contradict each other: "
                              "pass one")
    old, new = _schedule(saved), _schedule(current)
    changed = [flag for flag in old if old[flag] != new[flag]]
    if not changed or ckpt.override_opt_param_scheduler:
        return
    if ckpt.use_checkpoint_opt_param_scheduler:
        opt, train = current.optimizer, saved.training
        for _, name in SCHEDULE_FLAGS:
            setattr(opt, name, getattr(saved.optimizer, name))
        warmup, decay = schedule_iterations(saved.optimizer, train)
        # the saved lengths in this run's units (iterations, or samples under --train-samples)
        per_step = current.training.global_batch_size if current.training.train_samples else 1
        opt.lr_warmup_fraction = None
        opt.lr_warmup_iters, opt.lr_decay_iters = round(warmup), round(decay)
        opt.lr_warmup_samples = round(warmup * per_step)
        opt.lr_decay_samples = round(decay * per_step)
        return
    differences = "; ".join(f"{flag}: {old[flag]} in the checkpoint, {new[flag]} now"
                            for flag in changed)
    raise CheckpointError(f"checkpoint {root} was trained with another learning-rate/weight-decay "
                          f"schedule ({differences}): pass --use-checkpoint-opt_param-scheduler "
                          f"to continue the checkpoint's or --override-opt_param-scheduler to "
                          f"use these flags'")


def _check_parameters(state: dict, names: list[str], shapes: list, path: str) -> None:
    missing = [n for n in names if n not in state["model"]]
    unexpected = [n for n in state["model"] if n not in set(names)]
    if missing or unexpected:
        raise CheckpointError(f"{path} does not hold this stage's parameters: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    for name, shape in zip(names, shapes):
        if tuple(state["model"][name].shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: parameter {name} has shape {tuple(state['model'][name].shape)}, this "
                f"model's is {tuple(shape)} (a different --make-vocab-size-divisible-by?)")


@torch.no_grad()
def load_checkpoint(stage, root: str, iteration: int | None = None) -> dict | None:
    """Load this rank's stage from `root` (the latest iteration by default). Returns the RNG states
    to restore once the run is ready to train (None with --finetune/--no-load-rng): building data
    loaders draws from the torch generator, so restoring them here would be undone."""
    metadata = read_metadata(root, iteration)
    iteration = metadata["iteration"]
    layout, ckpt = stage.layout, stage.config.checkpoint
    check_architecture(Config.from_dict(metadata["config"]), stage.config, root)
    check_layout(metadata, root, stage.config)  # its split check needs the same --num-layers
    c = layout.coords
    path = model_file(root, iteration, c.tp, c.pp)
    v = stage.versions
    rng = None
    error = None
    try:  # this rank's files, read and checked before any rank changes its stage
        state = load_file(path)
        _check_parameters(state, v.names, v.shapes, path)
        if not (ckpt.finetune or ckpt.no_load_rng):
            rng = _load_rng(root, iteration, c)
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it, or the rest hang
        error = caught
    _raise_if_any_rank_failed(error, layout)
    # Megatron-LM: the schedule with the optimizer, where the checkpoint has one (a converted or
    # imported model has none, nor a schedule of its own)
    if not (ckpt.finetune or ckpt.no_load_optim) and state["optimizer"]["state"]:
        saved_config = Config.from_dict(metadata["config"])
        check_optimizer(saved_config, stage.config, root)
        resolve_schedule(saved_config, stage.config, root)
    v.load_full_master([state["model"][name] for name in v.names])  # sharded: this rank's part
    if ckpt.finetune:  # weights only: training starts at iteration 0 with a fresh optimizer
        v.reset(0)
        _barrier(layout)
        print_once(layout, f" loaded weights of {root} (iteration {iteration}) for fine-tuning")
        return None
    # every version from the one batch N reads (2BW: N-1; PipeDream: N-(p-1-s)) to the newest
    needed = range(v.version_for_batch(iteration), iteration + 1)
    saved_versions = {int(k): t for k, t in state["versions"].items()}
    v.reset(iteration, {version: [saved_versions.get(version, state["model"])[n] for n in v.names]
                        for version in needed})
    if not ckpt.no_load_optim:
        names_of = {id(m): name for name, m in zip(v.names, v.master)}
        stage.optimizer.load_state_dict(
            optimizer_state_by_index(stage.optimizer, state["optimizer"], names_of))
        if state["loss_scaler"]:  # converted or imported checkpoints may have none
            stage.scaler.load_state_dict(state["loss_scaler"])
        stage.applied_steps.skipped = state.get("skipped_steps", 0)
        if stage.updater.compensation is not None:
            stage.updater.compensation.load_state(state.get("delay_compensation"))
        if stage.updater.pipemare is not None:
            stage.updater.pipemare.load_state_dict(state.get("pipemare"))
    stage.iteration = state["iteration"]
    stage.consumed_samples = state["consumed_samples"]
    stage.consumed_valid_samples = state.get("consumed_valid_samples", 0)
    _barrier(layout)  # "loaded" only once every rank has
    print_once(layout, f" loaded checkpoint {root} at iteration {stage.iteration}")
    return rng


def _load_rng(root: str, iteration: int, c) -> dict | None:
    rng_path = rng_file(root, iteration, c.tp, c.pp, c.dp)
    if not os.path.exists(rng_path):  # converted checkpoint or more data-parallel replicas
        if c.tp == 0 and c.pp == 0:  # once per data-parallel replica
            print(f" {rng_path} not found: the RNG states of data-parallel replica {c.dp} start "
                  f"fresh from --seed", flush=True)
        return None
    return load_file(rng_path)


def _raise_if_any_rank_failed(error: Exception | None, layout) -> None:
    """Collective: when any rank failed to read its files, every rank raises the same error,
    naming each failed rank and what it met (the job stops with one line, none waits)."""
    mine = None if error is None else f"{layout.describe()}: {error}"
    messages = [mine]
    if dist.is_initialized() and layout.world_size > 1:
        messages = [None] * layout.world_size
        dist.all_gather_object(messages, mine)
    failed = [m for m in messages if m is not None]
    if failed:
        raise CheckpointError("loading the checkpoint failed on " + "; ".join(failed))


def _barrier(layout) -> None:
    if dist.is_initialized() and layout.world_size > 1:
        dist.barrier()


def adopt_checkpoint_layout(config: Config, typed: set) -> tuple[set, list[str]]:
    """--load: the layer split (and, resuming, the pipeline schedule) the checkpoint was trained
    with, where no flag sets them and the pipeline size is the checkpoint's, so continuing a run
    needs no flags repeated (nor --auto-parallel a different split). Under
    --pipeline-repartition-interval the checkpoint's split and recompute plan win over typed ones:
    the command line names the split the job started from, the checkpoint where its layers are. Returns `typed` with the
    adopted fields added (--auto-parallel keeps them pinned) and the flags adopted, for the log."""
    root, par = config.checkpoint.load, config.parallel
    if not root or not has_checkpoint(root):
        return set(typed), []
    saved = saved_config(root).parallel
    if saved.pipeline_parallel != par.pipeline_parallel:  # check_layout names the mismatch
        return set(typed), []
    typed, adopted = set(typed), []
    # a repartitioning job's typed split is where it started; it continues where its layers went
    moved = par.repartition_interval is not None and saved.layer_split \
        and saved.layer_split != par.layer_split
    if (("parallel", "layer_split") not in typed or moved) and saved.layer_split:
        par.layer_split = list(saved.layer_split)
        typed.add(("parallel", "layer_split"))
        adopted.append(f"--pipeline-layer-split {','.join(map(str, saved.layer_split))}"
                       + (" (where repartitioning moved the layers)" if moved else ""))
        plan = saved_config(root).recompute.num_layers_per_stage
        if moved and plan != config.recompute.num_layers_per_stage:
            config.recompute.num_layers_per_stage = list(plan) if plan is not None else None
            typed.add(("recompute", "num_layers_per_stage"))
            if plan is not None:
                adopted.append(f"--recompute-num-layers-per-stage {','.join(map(str, plan))}")
    if ("parallel", "schedule") not in typed and not config.checkpoint.finetune \
            and saved.pipeline_schedule != par.pipeline_schedule:
        par.schedule = saved.pipeline_schedule
        typed.add(("parallel", "schedule"))
        adopted.append(f"--pipeline-schedule {saved.pipeline_schedule}")
    return typed, adopted


def has_checkpoint(root: str) -> bool:
    return os.path.isdir(root) and read_marker(root) is not None


def maybe_load_checkpoint(stage) -> dict | None:
    """--load DIR: resume (Megatron's behaviour: an empty DIR starts from scratch, with a warning,
    except under --finetune, which needs weights)."""
    root = stage.config.checkpoint.load
    if not root:
        return None
    if not has_checkpoint(root):
        ckpt = stage.config.checkpoint
        if ckpt.finetune or ckpt.exit_on_missing_checkpoint:
            flag = "--finetune" if ckpt.finetune else "--exit-on-missing-checkpoint"
            raise CheckpointError(f"{flag} --load {root}: no checkpoint there ({MARKER} "
                                  f"is missing)")
        print_once(stage.layout, f" WARNING: --load {root} holds no checkpoint ({MARKER} is "
                                 f"missing): training starts from scratch")
        return None
    return load_checkpoint(stage, root)


def print_once(layout, message: str) -> None:
    if layout.rank == 0:
        print(message, flush=True)
