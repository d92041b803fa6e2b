"""BlendedDataset: interleave datasets in fixed proportions (--data-path 0.3 A 0.7 B).

Dataset d's k-th sample is placed at "time" (k + 1/2) / w_d and the samples are taken in time
order, so after any n samples dataset d has supplied w_d * n of them to within one sample. The
order is deterministic and needs no random numbers or cache (it is a sort).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def normalize_weights(weights: Sequence[float], flag: str = "--data-path") -> list[float]:
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{flag} weights must be non-negative numbers with a positive sum, "
                         f"got {list(weights)}")
    total = float(sum(weights))
    return [w / total for w in weights]


def samples_needed(weight: float, num_samples: int) -> int:
    """How many samples a constituent must provide for a blend of num_samples."""
    return math.ceil(weight * num_samples) + 1


def blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of sample i, index of sample i within that dataset) for i < num_samples."""
    times, owners, ranks = [], [], []
    for d, weight in enumerate(weights):
        if weight == 0:
            continue
        k = np.arange(samples_needed(weight, num_samples), dtype=np.int64)
        times.append((k + 0.5) / weight)
        owners.append(np.full(len(k), d, dtype=np.int64))
        ranks.append(k)
    order = np.argsort(np.concatenate(times), kind="stable")[:num_samples]
    return np.concatenate(owners)[order], np.concatenate(ranks)[order]


class BlendedDataset:
    """`dataset[i]` is sample dataset_sample_index[i] of datasets[dataset_index[i]]."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, num_samples)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int):
        dataset = self.datasets[self.dataset_index[index]]
        # constituents are built with samples_needed() samples; the modulo only guards rounding
        return dataset[int(self.dataset_sample_index[index]) % len(dataset)]
