import itertools

import numpy as np
import pytest
import torch

from megatron_2bw.data.gpt_dataset import GPTDataset
from megatron_2bw.data.indexed import IndexedDataset
from megatron_2bw.data.samplers import PretrainingSampler, build_data_iterator
from tests.data.helpers import write_dataset


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_megatron_order_and_wraparound():
    assert _take(PretrainingSampler(100, 0, 2, 0, 3), 3) == [[0, 1], [6, 7], [12, 13]]
    assert _take(PretrainingSampler(100, 0, 2, 2, 3), 2) == [[4, 5], [10, 11]]
    assert _take(PretrainingSampler(10, 6, 3, 1, 2), 2) == [[9, 0, 1], [5, 6, 7]]  # past the end


def test_resume_continues_exactly():
    full = _take(PretrainingSampler(50, 0, 2, 1, 2), 30)
    for step in (1, 7, 13):  # stop after `step` global batches of 2 x 2 samples, then resume
        resumed = _take(PretrainingSampler(50, step * 4, 2, 1, 2), 30 - step)
        assert resumed == full[step:]


@pytest.mark.parametrize("bad, message", [
    (dict(total_samples=0), "empty"), (dict(data_parallel_rank=2), "outside"),
    (dict(micro_batch_size=0), "positive"), (dict(consumed_samples=-1), ">= 0")])
def test_bad_arguments(bad, message):
    arguments = dict(total_samples=10, consumed_samples=0, micro_batch_size=2,
                     data_parallel_rank=0, data_parallel_size=2) | bad
    with pytest.raises(ValueError, match=message):
        PretrainingSampler(**arguments)


def _global_batches(dataset, data_parallel_size, global_batch, steps, consumed=0, workers=0):
    """The samples of each global batch, gathered over the ranks (micro batch 2)."""
    micro = 2
    per_rank = global_batch // (micro * data_parallel_size)
    iterators = [build_data_iterator(dataset, consumed, micro, rank, data_parallel_size, workers)
                 for rank in range(data_parallel_size)]
    batches = []
    for _ in range(steps):
        rows = [next(it)["tokens"] for it in iterators for _ in range(per_rank)]
        assert all(r.dtype == torch.int64 and r.shape == (micro, 17) for r in rows)
        batches.append(sorted(map(tuple, torch.cat(rows).tolist())))
    return batches


def test_global_batches_do_not_depend_on_data_parallel_size(tmp_path):
    documents = [[list(range(i * 100, i * 100 + 20 + i))] for i in range(30)]
    indexed = IndexedDataset(write_dataset(tmp_path / "d", documents))
    dataset = GPTDataset(indexed, 200, 16, seed=1, cache_dir=str(tmp_path))
    one = _global_batches(dataset, 1, 8, 5)
    assert one == _global_batches(dataset, 2, 8, 5) == _global_batches(dataset, 4, 8, 5)
    assert len(set(map(tuple, one))) == 5  # distinct batches
    # resuming from consumed samples (and loading in worker processes) continues exactly
    assert _global_batches(dataset, 2, 8, 3, consumed=16, workers=1) == one[2:5]
    expected = [dataset[i]["tokens"] for i in range(8)]
    assert sorted(map(tuple, np.stack(expected).tolist())) == one[0]
