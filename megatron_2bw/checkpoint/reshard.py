"""Checkpoints between layouts: merge every rank's shards into one unsharded state, split it again.

A checkpoint names parameters by global layer index and records each one's ParamSpec (full shape,
partition dimension), so merging is a concatenation along `partition_dim` and splitting a chunk
along it; which stage holds a parameter follows from its name. Vocabulary-sized tensors are padded
to a multiple of make_vocab_size_divisible_by * t (the padding depends on t): the unsharded state
keeps the true vocabulary only, and each layout re-pads with zeros (padding rows never reach the
loss). The last stage's tied copy of the word embeddings is rebuilt from the first stage's.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from megatron_2bw.config import Config, ModelConfig
from megatron_2bw.checkpoint.save_load import (FORMAT, CheckpointError, atomic_save, load_file,
                                               model_file, read_metadata, write_marker,
                                               write_metadata)
from megatron_2bw.models import MODELS
from megatron_2bw.pipeline.partition import layer_ranges

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
# Parameters with one row per vocabulary entry (padded per layout).
VOCAB_PARAMETERS = (WORD_EMBEDDINGS, "output_embedding", "output_layer", "heads.lm_bias")


@dataclass
class FullState:
    """A checkpoint without its layout: unsharded tensors by parameter name, true vocabulary."""
    config: Config
    model: dict[str, torch.Tensor]
    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0
    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # live 2BW versions
    optimizer: dict | None = None  # {"groups": [{..., "params": [names]}], "state": {name: {...}}}
    loss_scaler: dict | None = None


# -- one tensor --------------------------------------------------------------------------------------

def merge_shards(shards: list[torch.Tensor], partition_dim: int | None, name: str,
                 vocab_size: int) -> torch.Tensor:
    full = shards[0] if partition_dim is None else torch.cat(shards, dim=partition_dim)
    return full[:vocab_size].clone() if name in VOCAB_PARAMETERS else full


def shard_of(full: torch.Tensor, name: str, full_shape, partition_dim: int | None, tp_rank: int,
             tp_size: int) -> torch.Tensor:
    """This rank's slice of an unsharded tensor (vocabulary rows padded with zeros to full_shape)."""
    full_shape = tuple(full_shape)
    if name in VOCAB_PARAMETERS and full.shape[0] < full_shape[0]:
        padding = full.new_zeros((full_shape[0] - full.shape[0],) + tuple(full.shape[1:]))
        full = torch.cat([full, padding])
    if tuple(full.shape) != full_shape:
        raise CheckpointError(f"parameter {name}: the checkpoint holds shape {tuple(full.shape)}, "
                              f"the model expects {full_shape}")
    if partition_dim is None:
        return full.clone()
    return full.chunk(tp_size, dim=partition_dim)[tp_rank].clone()  # clone: save only the slice


# -- read: every rank file -> FullState --------------------------------------------------------------

def _merge_optimizer_groups(groups: list[dict], new: list[dict]) -> None:
    """Groups of all files, matched by their hyper-parameters; parameter names listed once."""
    for group in new:
        settings = {k: v for k, v in group.items() if k != "params"}
        match = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == settings),
                     None)
        if match is None:
            match = {**settings, "params": []}
            groups.append(match)
        match["params"] += [n for n in group["params"] if n not in match["params"]]


def read_full_state(root: str, iteration: int | None = None, with_optimizer: bool = True,
                    show_progress: bool = True) -> FullState:
    metadata = read_metadata(root, iteration)
    iteration, layout = metadata["iteration"], metadata["layout"]
    config = Config.from_dict(metadata["config"])
    vocab = config.model.vocab_size
    state = FullState(config, {}, iteration, metadata["consumed_samples"],
                      metadata.get("consumed_valid_samples", 0))
    groups: list[dict] = []
    optimizer_state: dict[str, dict] = {}
    for pp in tqdm(range(layout["pipeline"]), desc=f"reading {root}", unit="stage",
                   disable=not show_progress or layout["pipeline"] * layout["tensor"] < 4):
        ranks = [load_file(model_file(root, iteration, tp, pp)) for tp in range(layout["tensor"])]
        first = ranks[0]
        if first.get("format") != FORMAT:
            raise CheckpointError(f"{model_file(root, iteration, 0, pp)} has format "
                                  f"{first.get('format')!r}, expected {FORMAT!r}")
        for name, spec in first["specs"].items():
            if spec["tied_copy"]:  # rebuilt from the first stage's word embeddings
                continue
            dim = spec["partition_dim"]
            state.model[name] = merge_shards([r["model"][name] for r in ranks], dim, name, vocab)
            for version in first["versions"]:
                state.versions.setdefault(int(version), {})[name] = merge_shards(
                    [r["versions"][version][name] for r in ranks], dim, name, vocab)
            if with_optimizer and name in first["optimizer"]["state"]:
                shard_shape = first["model"][name].shape
                optimizer_state[name] = {
                    key: merge_shards([r["optimizer"]["state"][name][key] for r in ranks], dim,
                                      name, vocab)
                    if torch.is_tensor(value) and value.shape == shard_shape else value
                    for key, value in first["optimizer"]["state"][name].items()}
        if with_optimizer:
            _merge_optimizer_groups(groups, first["optimizer"]["groups"])
            state.loss_scaler = first["loss_scaler"]
    if with_optimizer:
        for group in groups:
            group["params"] = [n for n in group["params"] if n in state.model]
        state.optimizer = {"groups": [g for g in groups if g["params"]], "state": optimizer_state}
    return state


# -- write: FullState -> rank files of a layout ------------------------------------------------------

def check_layout_fits(model: ModelConfig, tensor: int, pipeline: int,
                      tensor_flag: str = "--tensor-model-parallel-size",
                      pipeline_flag: str = "--pipeline-model-parallel-size") -> None:
    for what, size in (("--num-attention-heads", model.num_attention_heads),
                       ("--hidden-size", model.hidden_size), ("--ffn-hidden-size", model.ffn_hidden_size),
                       ("--num-query-groups", model.query_groups)):
        if tensor < 1 or size % tensor:
            raise CheckpointError(f"{tensor_flag} {tensor} must be positive and divide the model's "
                                  f"{what} {size}")
    if not 1 <= pipeline <= model.num_layers:
        raise CheckpointError(f"{pipeline_flag} {pipeline} must be between 1 and the model's "
                              f"--num-layers {model.num_layers}")


def stage_parameter_specs(model: ModelConfig, tensor: int, layers: range, pre_process: bool,
                          post_process: bool) -> list[tuple[str, object]]:
    """(name, ParamSpec with the full shape under t) of one stage, in the module's order; built on
    the meta device, so no memory is spent on weights."""
    with torch.device("meta"):
        module = MODELS[model.model_type](model, None, model.padded_vocab_size(tensor), layers,
                                          pre_process, post_process)
    return [(name, param.spec) for name, param in module.named_parameters()]


def _source_name(name: str, spec) -> str:
    return WORD_EMBEDDINGS if spec.tied_copy else name


def _rank_parameter_specs(model: ModelConfig, tensor: int, pipeline: int, chunks: int,
                          layer_split: list[int] | None, pp: int) -> list[tuple[str, object]]:
    """(name, spec) of pipeline rank pp: its stage, or under the interleaved schedule its chunks
    (chunk c: virtual stage c * p + pp of p * chunks even ones)."""
    if chunks == 1:
        ranges = layer_ranges(model.num_layers, pipeline, layer_split)
        return stage_parameter_specs(model, tensor, ranges[pp], pp == 0, pp == pipeline - 1)
    ranges = layer_ranges(model.num_layers, pipeline * chunks)
    return [spec for c in range(chunks) for spec in stage_parameter_specs(
        model, tensor, ranges[c * pipeline + pp], c == 0 and pp == 0,
        c == chunks - 1 and pp == pipeline - 1)]


def write_full_state(state: FullState, root: str, tensor: int, pipeline: int,
                     layer_split: list[int] | None = None, chunks: int = 1) -> None:
    """Write `state` as a checkpoint of layout t x p (every file, the metadata, then the marker),
    with `chunks` model chunks per pipeline rank (the interleaved schedule's v).
    RNG states are per rank of the old layout: none are written (a resumed run reseeds)."""
    model = state.config.model
    check_layout_fits(model, tensor, pipeline)
    if chunks > 1 and (layer_split is not None or model.num_layers % (pipeline * chunks)):
        raise CheckpointError(f"{chunks} model chunks per rank need --num-layers "
                              f"{model.num_layers} divisible by {pipeline} x {chunks} (and no "
                              f"layer split)")
    config = copy.deepcopy(state.config)
    config.parallel.tensor_parallel, config.parallel.pipeline_parallel = tensor, pipeline
    config.parallel.layer_split = layer_split
    config.parallel.num_layers_per_virtual_pipeline_stage = None
    config.parallel.virtual_pipeline_parallel = chunks if chunks > 1 else None
    if chunks > 1:
        config.parallel.schedule = "interleaved"
    elif config.parallel.schedule == "interleaved":
        config.parallel.schedule = None
    optimizer = state.optimizer or {"groups": [], "state": {}}
    progress = tqdm(total=tensor * pipeline, desc=f"writing {root}", unit="file",
                    disable=tensor * pipeline < 4)
    for pp in range(pipeline):
        specs = _rank_parameter_specs(model, tensor, pipeline, chunks, layer_split, pp)
        missing = [n for n, s in specs if _source_name(n, s) not in state.model]
        if missing:
            raise CheckpointError(f"the checkpoint lacks parameters {missing[:3]} of a "
                                  f"{model.model_type} model with this configuration")
        for tp in range(tensor):
            def cut(full: torch.Tensor, name: str, spec) -> torch.Tensor:
                return shard_of(full, name, spec.full_shape, spec.partition_dim, tp, tensor)

            file = {
                "format": FORMAT, "iteration": state.iteration,
                "consumed_samples": state.consumed_samples,
                "consumed_valid_samples": state.consumed_valid_samples, "config": config.to_dict(),
                "layout": {"tensor": tensor, "pipeline": pipeline, "data": 1},
                "tp_rank": tp, "pp_rank": pp,
                "specs": {n: {"full_shape": list(s.full_shape), "partition_dim": s.partition_dim,
                              "tied": s.tied, "tied_copy": s.tied_copy} for n, s in specs},
                "model": {n: cut(state.model[_source_name(n, s)], n, s) for n, s in specs},
                "versions": {v: {n: cut(tensors[_source_name(n, s)], n, s) for n, s in specs}
                             for v, tensors in state.versions.items()},
                "optimizer": _stage_optimizer(optimizer, specs, cut, state.model),
                "loss_scaler": state.loss_scaler or {},
            }
            atomic_save(file, model_file(root, state.iteration, tp, pp))
            progress.update()
    progress.close()
    write_metadata(root, state.iteration, state.consumed_samples, config, tensor, pipeline, 1,
                   state.consumed_valid_samples)
    write_marker(root, state.iteration)


def _stage_optimizer(optimizer: dict, specs, cut, model: dict[str, torch.Tensor]) -> dict:
    """The stage's share of the optimizer: parameter-shaped state (momenta) is cut like the
    parameter, the rest (Adam's step count) copied."""
    stage_state = {}
    for name, spec in specs:
        source = _source_name(name, spec)
        saved = optimizer["state"].get(source)
        if saved is None:
            continue
        stage_state[name] = {key: cut(value, name, spec)
                             if torch.is_tensor(value) and value.shape == model[source].shape
                             else value for key, value in saved.items()}
    names = {_source_name(n, s): n for n, s in specs}  # the tied copy joins its source's group
    groups = []
    for group in optimizer["groups"]:
        members = [names[n] for n in group["params"] if n in names]
        members += [n for n, s in specs if s.tied_copy and WORD_EMBEDDINGS in group["params"]
                    and n not in members]
        if members:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
    return {"groups": groups, "state": stage_state}


# -- into a live module ------------------------------------------------------------------------------

@torch.no_grad()
def load_full_weights(module: torch.nn.Module, state: FullState) -> None:
    """Fill a module built for any layout (its ParamSpecs know the rank's slice) from `state`."""
    for name, param in module.named_parameters():
        spec = param.spec
        source = _source_name(name, spec)
        if source not in state.model:
            raise CheckpointError(f"the checkpoint has no parameter {source}")
        param.copy_(shard_of(state.model[source], name, spec.full_shape, spec.partition_dim,
                             spec.tp_rank, spec.tp_size))
