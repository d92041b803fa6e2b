import warnings

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

from megatron_2bw.evaluation.metrics import (
    METRICS, accuracy, f1, matthews_corrcoef, pearson, spearman)


def test_known_values():
    predictions, labels = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]
    assert accuracy(predictions, labels) == pytest.approx(3 / 5)
    # TP=2, FP=1, FN=1 -> precision = recall = 2/3
    assert f1(predictions, labels) == pytest.approx(2 / 3)
    # (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (2 - 1) / sqrt(3*3*2*2)
    assert matthews_corrcoef(predictions, labels) == pytest.approx(1 / 6)
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # monotonic but not linear: Spearman sees a perfect order, Pearson does not
    assert spearman([1, 2, 3, 4], [1, 10, 100, 1000]) == pytest.approx(1.0)
    assert pearson([1, 2, 3, 4], [1, 10, 100, 1000]) < 0.95


@pytest.mark.parametrize("seed", range(5))
def test_classification_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(5, 200))
    labels = rng.integers(0, 2, size)
    predictions = np.where(rng.random(size) < 0.7, labels, 1 - labels)
    assert accuracy(predictions, labels) == pytest.approx(
        sklearn.metrics.accuracy_score(labels, predictions))
    assert f1(predictions, labels) == pytest.approx(sklearn.metrics.f1_score(labels, predictions))
    assert matthews_corrcoef(predictions, labels) == pytest.approx(
        sklearn.metrics.matthews_corrcoef(labels, predictions))
    three_class_labels, three_class_predictions = rng.integers(0, 3, size), rng.integers(0, 3, size)
    assert matthews_corrcoef(three_class_predictions, three_class_labels) == pytest.approx(
        sklearn.metrics.matthews_corrcoef(three_class_labels, three_class_predictions))


@pytest.mark.parametrize("seed", range(5))
def test_correlations_match_scipy(seed):
    rng = np.random.default_rng(seed)
    labels = rng.uniform(0, 5, 100)
    predictions = labels + rng.normal(0, 1.5, 100)
    assert pearson(predictions, labels) == pytest.approx(
        scipy.stats.pearsonr(predictions, labels)[0])
    assert spearman(predictions, labels) == pytest.approx(
        scipy.stats.spearmanr(predictions, labels)[0])
    # STS-B gold scores have many ties: ties must get their average rank
    tied_labels = np.round(labels)
    tied_predictions = np.round(predictions * 2) / 2
    assert spearman(tied_predictions, tied_labels) == pytest.approx(
        scipy.stats.spearmanr(tied_predictions, tied_labels)[0])


def test_degenerate_inputs_give_conventional_values_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN from 0/0 would warn
        assert matthews_corrcoef([1, 1, 1, 1], [0, 1, 0, 1]) == 0.0
        assert matthews_corrcoef([0, 1, 0, 1], [1, 1, 1, 1]) == 0.0
        assert matthews_corrcoef([1], [1]) == 0.0
        assert f1([0, 0, 0], [0, 0, 0]) == 0.0
        assert f1([0, 0, 0], [1, 1, 0]) == 0.0
        assert accuracy([2, 2], [2, 2]) == 1.0
        assert pearson([0.1] * 7, np.arange(7.0)) == 0.0  # 0.1 is inexact: no rounding noise
        assert pearson(np.arange(7.0), [3.0] * 7) == 0.0
        assert spearman([2.5] * 4, [1, 2, 3, 4]) == 0.0
        assert pearson([1.0], [2.0]) == 0.0


def test_bad_shapes_and_values_are_rejected():
    with pytest.raises(ValueError, match="3 predictions for 2 labels"):
        accuracy([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="at least one"):
        pearson([], [])
    with pytest.raises(ValueError, match="1-D"):
        accuracy([[0.1, 0.9]], [1])
    with pytest.raises(ValueError, match=r"binary F1 expects labels in \{0, 1\}"):
        f1([0, 1], [0, 2])


def test_registry_names():
    assert set(METRICS) == {"accuracy", "f1", "mcc", "pearson", "spearman"}
    assert all(isinstance(metric([1, 0], [1, 1]), float) for metric in METRICS.values())
