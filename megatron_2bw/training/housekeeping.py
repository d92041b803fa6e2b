"""Memory housekeeping at fixed points of the schedule: --manual-gc and
--empty-unused-memory-level."""
from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from megatron_2bw.config import TrainingConfig


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
