"""Megatron's pretraining sampler and the data iterator built on it.

Global sample numbers g = consumed_samples, consumed_samples + 1, ... are cut into groups of
micro_batch_size * data_parallel_size; rank r takes [r * micro, (r + 1) * micro) of each group.
So one global batch holds the same samples whatever the data-parallel size, and resuming from a
consumed-samples count continues exactly where training stopped. Sample g reads dataset index
g % total_samples: past the end, a new pass over the dataset begins.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, default_collate


class PretrainingSampler:
    """Yields, forever, this rank's list of dataset indices for each micro batch."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples <= 0:
            raise ValueError(f"the dataset is empty (total_samples = {total_samples})")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"--micro-batch-size ({micro_batch_size}) and the data-parallel size "
                             f"({data_parallel_size}) must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} is outside "
                             f"[0, {data_parallel_size})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __iter__(self) -> Iterator[list[int]]:
        group = self.micro_batch_size * self.data_parallel_size
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        while True:
            yield [(first + i) % self.total_samples for i in range(self.micro_batch_size)]
            first += group


def _single_thread_worker(_worker_id: int) -> None:
    torch.set_num_threads(1)


def build_data_iterator(dataset, consumed_samples: int, micro_batch_size: int,
                        data_parallel_rank: int, data_parallel_size: int,
                        num_workers: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Endless iterator of this rank's micro batches: dicts of tensors, batch dimension first."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 data_parallel_rank, data_parallel_size)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                        collate_fn=default_collate, pin_memory=torch.cuda.is_available(),
                        worker_init_fn=_single_thread_worker if num_workers > 0 else None,
                        persistent_workers=num_workers > 0)
    return iter(loader)
