"""Helpers for the precision, distributed-optimizer and memory tests: train the tiny GPT through the
real stage machinery on gloo ranks and report weights, step results and memory."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from megatron_2bw.config import Config, PrecisionConfig
from megatron_2bw.memory import optimizer_state_tensors, storage_bytes
from megatron_2bw.planner.memory import estimate_stage_memory
from megatron_2bw.training.segments import run_segment
from megatron_2bw.training.stage import static_tensors
from tests.pipeline.harness import gpt_feed, stage_on_rank, tiny_config


def precise_config(precision: str = "fp32", **kwargs) -> Config:
    """tiny_config with --fp16 / --bf16 (fp16: a dynamic scale that starts low enough not to
    overflow; bf16: fp32 gradient accumulation, as Megatron does)."""
    config = tiny_config(**kwargs)
    if precision == "fp16":
        config.precision = PrecisionConfig(fp16=True, initial_loss_scale=2.0 ** 12)
    elif precision == "bf16":
        config.precision = PrecisionConfig(bf16=True, accumulate_allreduce_grads_in_fp32=True)
    return config


def with_changes(config: Config, **sections) -> Config:
    """A copy of `config` with fields replaced per section: with_changes(c, parallel={...})."""
    changed = {name: dataclasses.replace(getattr(config, name), **fields)
               for name, fields in sections.items()}
    return dataclasses.replace(config, **changed)


class CountingDataset:
    """Sample i counts up by one from 7i (mod the vocabulary): learnable in a few steps, so the
    loss falls and precision errors would show."""

    def __init__(self, seq_length: int, vocab_size: int):
        self.seq_length, self.vocab_size = seq_length, vocab_size

    def __getitem__(self, i: int) -> dict:
        return {"tokens": (7 * i + np.arange(self.seq_length + 1)) % self.vocab_size}


def train_stage(rank: int, world: int, config: Config, batches: int, before=None,
                learnable: bool = False, measure: bool = False) -> dict:
    """Run `batches` batches on this rank (mock or `CountingDataset` samples); return its
    coordinates, the full master weights (every rank), step results and memory figures (with
    `measure`, the peak includes transients: slower)."""
    results = []
    layout, stage = stage_on_rank(rank, world, config, on_step=results.append)
    stage.memory.set_static(static_tensors(stage))
    static = stage.memory.static_bytes
    if before is not None:
        before(stage)
    dataset = (CountingDataset(config.model.seq_length, config.model.vocab_size)
               if learnable else None)
    with stage.memory.measure() if measure else contextlib.nullcontext():
        run_segment(stage, 0, batches, gpt_feed(config, layout, dataset))
    v = stage.versions
    c = layout.coords
    estimate = estimate_stage_memory(
        config.model, config.parallel, config.precision, config.recompute,
        config.optimizer.optimizer, config.training.micro_batch_size, stage.microbatches,
        layout.data, layout.stage)
    return {
        "coords": (c.tp, c.dp, c.pp),
        "weights": {n: (m.clone(), spec) for n, m, spec in zip(v.names, v.full_master(), v.specs)},
        "results": [(r.batch, r.skipped, r.grad_norm, r.loss_scale, r.metrics) for r in results],
        "distinct_versions": v.distinct_versions,
        "working_dtype": v.versions[v.newest][0].dtype,
        "static_bytes": static,
        "optimizer_bytes": storage_bytes(optimizer_state_tensors(stage.optimizer)),
        "peak_bytes": stage.memory.peak_bytes(),
        "peak_activation_bytes": stage.memory.peak_activation_bytes,
        "peak_measured_bytes": stage.memory.peak_measured_bytes,
        "parameters": sum(v.layout.numels),
        "estimate": dataclasses.asdict(estimate) | {"total": estimate.total},
    }
