"""Classification and regression metrics of the GLUE benchmark, in plain numpy (no scipy import).

Every metric takes (predictions, labels) as 1-D sequences of equal, non-zero length and returns a
Python float. Degenerate inputs give the conventional value instead of NaN: a correlation (MCC,
Pearson, Spearman) with a constant side is 0.0 (no linear relation can be measured), and F1 with no
positive prediction and no positive label is 0.0 (scikit-learn's default for zero division).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike


def _pair(predictions: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.ndim != 1 or labels.ndim != 1:
        raise ValueError(f"metrics expect 1-D predictions and labels, got shapes "
                         f"{predictions.shape} and {labels.shape}")
    if len(predictions) != len(labels):
        raise ValueError(f"metrics got {len(predictions)} predictions for {len(labels)} labels")
    if len(labels) == 0:
        raise ValueError("metrics need at least one prediction")
    return predictions, labels


def accuracy(predictions: ArrayLike, labels: ArrayLike) -> float:
    predictions, labels = _pair(predictions, labels)
    return float(np.mean(predictions == labels))


def f1(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Binary F1 of the positive class 1 (class 0 is negative)."""
    predictions, labels = _pair(predictions, labels)
    for name, values in (("predictions", predictions), ("labels", labels)):
        if not np.isin(values, (0, 1)).all():
            raise ValueError(f"binary F1 expects {name} in {{0, 1}}, got {np.unique(values)[:10]}")
    true_positives = np.sum((predictions == 1) & (labels == 1))
    # F1 = 2TP / (2TP + FP + FN) = 2TP / (#predicted positive + #actual positive)
    positives = np.sum(predictions == 1) + np.sum(labels == 1)
    return float(2 * true_positives / positives) if positives else 0.0


def matthews_corrcoef(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Matthews correlation for any number of classes (Gorodkin's R_K); binary MCC for two."""
    predictions, labels = _pair(predictions, labels)
    classes, encoded = np.unique(np.concatenate([labels, predictions]), return_inverse=True)
    true_index, predicted_index = encoded[:len(labels)], encoded[len(labels):]
    confusion = np.zeros((len(classes), len(classes)), dtype=np.float64)
    np.add.at(confusion, (true_index, predicted_index), 1.0)
    true_counts, predicted_counts = confusion.sum(axis=1), confusion.sum(axis=0)
    samples, correct = confusion.sum(), np.trace(confusion)
    covariance = correct * samples - predicted_counts @ true_counts
    predicted_variance = samples ** 2 - predicted_counts @ predicted_counts
    true_variance = samples ** 2 - true_counts @ true_counts
    if predicted_variance == 0 or true_variance == 0:  # one side is constant
        return 0.0
    return float(covariance / np.sqrt(predicted_variance * true_variance))


def pearson(predictions: ArrayLike, labels: ArrayLike) -> float:
    predictions, labels = _pair(predictions, labels)
    x, y = predictions.astype(np.float64), labels.astype(np.float64)
    # Test constancy exactly: after mean-centring, rounding noise would give a spurious correlation.
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    x, y = x - x.mean(), y - y.mean()
    r = (x @ y) / np.sqrt((x @ x) * (y @ y))
    return float(np.clip(r, -1.0, 1.0))


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks; tied values share the mean of the ranks they span."""
    _, group, counts = np.unique(values, return_inverse=True, return_counts=True)
    last_rank = np.cumsum(counts)
    first_rank = last_rank - counts + 1
    return ((first_rank + last_rank) / 2.0)[group]


def spearman(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Pearson correlation of the ranks."""
    predictions, labels = _pair(predictions, labels)
    return pearson(_average_ranks(predictions), _average_ranks(labels))


METRICS: dict[str, Callable[[ArrayLike, ArrayLike], float]] = {
    "accuracy": accuracy,
    "f1": f1,
    "mcc": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}
