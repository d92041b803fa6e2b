"""Megatron-style checkpoints that lose nothing, written atomically.

Layout (one directory per saved iteration, one file per model-parallel rank):
    SAVE/latest_checkpointed_iteration.txt          written last, atomically
    SAVE/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   (data-parallel rank 0)
    SAVE/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/rng_dp{dp:03d}.pt    (every rank: its RNG states)
A file holds the stage's fp32 master weights by parameter name, every live working version (2BW keeps
two), the optimizer and loss-scaler states, the configuration, the iteration and consumed samples.
Every file is written under a temporary name and renamed; the marker follows a barrier, so a crash
during a save leaves the previous checkpoint as `latest`.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_2bw.tensor_parallel.random import load_rng_state_dict, rng_state_dict

MARKER = "latest_checkpointed_iteration.txt"
CONVERT_HINT = "convert it with tools/convert_checkpoint.py --target-tensor-parallel-size T " \
               "--target-pipeline-parallel-size P"


class CheckpointError(RuntimeError):
    pass


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir(root: str, iteration: int, tp: int, pp: int) -> str:
    return os.path.join(iteration_dir(root, iteration), f"mp_rank_{tp:02d}_{pp:03d}")


def atomic_save(obj, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_marker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{MARKER}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MARKER))


def read_marker(root: str) -> int | None:
    path = os.path.join(root, MARKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def stage_state(stage) -> dict:
    v = stage.versions
    versions = {} if v.alias else {
        version: [t.detach().cpu() for t in leaves] for version, leaves in v.versions.items()}
    return {
        "format": "megatron_2bw/1",
        "names": v.names,
        "master": {name: m.detach().cpu() for name, m in zip(v.names, v.master)},
        "versions": versions,
        "optimizer": stage.optimizer.state_dict(),
        "loss_scaler": stage.scaler.state_dict(),
        "iteration": stage.iteration,
        "consumed_samples": stage.consumed_samples,
        "config": stage.config.to_dict(),
        "layout": {"tensor": stage.layout.tensor, "pipeline": stage.layout.pipeline,
                   "data": stage.layout.data},
    }


def save_checkpoint(stage) -> str:
    """Collective over all ranks (call at a drained point)."""
    root, layout = stage.config.checkpoint.save, stage.layout
    c = layout.coords
    directory = rank_dir(root, stage.iteration, c.tp, c.pp)
    if hasattr(stage.optimizer, "consolidate_state_dict"):  # sharded optimizer: gather on dp 0
        stage.optimizer.consolidate_state_dict(to=layout.rank_of(c.tp, 0, c.pp))
    if c.dp == 0:
        atomic_save(stage_state(stage), os.path.join(directory, "model_optim_rng.pt"))
    atomic_save(rng_state_dict(), os.path.join(directory, f"rng_dp{c.dp:03d}.pt"))
    if dist.is_initialized() and layout.world_size > 1:
        dist.barrier()
    if layout.rank == 0:
        write_marker(root, stage.iteration)
        print(f" saved checkpoint at iteration {stage.iteration} to {root}", flush=True)
    if dist.is_initialized() and layout.world_size > 1:
        dist.barrier()
    return directory


def load_stage_file(root: str, iteration: int, tp: int, pp: int) -> dict:
    path = os.path.join(rank_dir(root, iteration, tp, pp), "model_optim_rng.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint in {root} is incomplete or was "
                              f"written with another layout; {CONVERT_HINT}")
    return torch.load(path, map_location="cpu", weights_only=False)


def check_layout(state: dict, root: str, tensor: int, pipeline: int) -> None:
    saved = state["layout"]
    if (saved["tensor"], saved["pipeline"]) != (tensor, pipeline):
        raise CheckpointError(
            f"checkpoint {root} was saved with --tensor-model-parallel-size {saved['tensor']} and "
            f"--pipeline-model-parallel-size {saved['pipeline']}, this run uses {tensor} and "
            f"{pipeline}; {CONVERT_HINT}")


@torch.no_grad()
def load_checkpoint(stage, root: str) -> None:
    iteration = read_marker(root)
    if iteration is None:
        raise CheckpointError(f"--load {root}: no {MARKER} (nothing saved there yet?)")
    layout, ckpt = stage.layout, stage.config.checkpoint
    c = layout.coords
    state = load_stage_file(root, iteration, c.tp, c.pp)
    check_layout(state, root, layout.tensor, layout.pipeline)
    v = stage.versions
    missing = [n for n in v.names if n not in state["master"]]
    if missing:
        raise CheckpointError(f"{root}: checkpoint lacks parameters {missing[:3]}... (another model?)")
    for name, m in zip(v.names, v.master):
        m.copy_(state["master"][name])
    if ckpt.finetune:  # weights only, training starts at iteration 0 with one version
        v.reset(0)
        return
    v.reset(state["iteration"], {int(k): t for k, t in state["versions"].items()})
    if not ckpt.no_load_optim:
        stage.optimizer.load_state_dict(state["optimizer"])
        stage.scaler.load_state_dict(state["loss_scaler"])
    stage.iteration = state["iteration"]
    stage.consumed_samples = state["consumed_samples"]
    if not ckpt.no_load_rng:
        rng_path = os.path.join(rank_dir(root, iteration, c.tp, c.pp), f"rng_dp{c.dp:03d}.pt")
        if os.path.exists(rng_path):
            load_rng_state_dict(torch.load(rng_path, weights_only=False))
    if layout.rank == 0:
        print(f" loaded checkpoint {root} at iteration {stage.iteration}", flush=True)


def maybe_load_checkpoint(stage) -> None:
    if stage.config.checkpoint.load:
        load_checkpoint(stage, stage.config.checkpoint.load)
