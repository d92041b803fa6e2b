import numpy as np
import pytest

from megatron_2bw.data.blended import BlendedDataset, blending_indices, samples_needed


class _Labelled:
    def __init__(self, label, size):
        self.label, self.size = label, size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return (self.label, index)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 2, 7], [0.05, 0.5, 0.45]])
def test_ratios_within_one_percent_at_every_prefix(weights):
    num_samples = 20_000
    normalised = np.asarray(weights) / sum(weights)
    datasets = [_Labelled(d, samples_needed(w, num_samples)) for d, w in enumerate(normalised)]
    blend = BlendedDataset(datasets, weights, num_samples)
    assert len(blend) == num_samples
    labels = np.array([blend[i][0] for i in range(num_samples)])
    for n in (1000, 5000, num_samples):
        counts = np.bincount(labels[:n], minlength=len(weights))
        assert np.all(np.abs(counts / n - normalised) < 0.01 * normalised)
    # every constituent is read in order, each sample once
    for d in range(len(weights)):
        taken = [blend[i][1] for i in np.flatnonzero(labels == d)]
        assert taken == list(range(len(taken))) and len(taken) <= datasets[d].size


def test_blend_is_deterministic_and_skips_zero_weights():
    a = blending_indices([0.25, 0.0, 0.75], 400)
    b = blending_indices([0.25, 0.0, 0.75], 400)
    assert np.array_equal(a[0], b[0]) and 1 not in a[0]


def test_bad_weights():
    with pytest.raises(ValueError, match="--data-path weights"):
        BlendedDataset([_Labelled(0, 10), _Labelled(1, 10)], [-1, 2], 10)
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        BlendedDataset([_Labelled(0, 10), _Labelled(1, 10)], [1], 10)
