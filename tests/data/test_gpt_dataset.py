import os

import numpy as np
import pytest

from megatron_2bw.data import gpt_dataset
from megatron_2bw.data.gpt_dataset import GPTDataset
from megatron_2bw.data.indexed import IndexedDataset
from tests.data.helpers import write_dataset

SEQ = 16


@pytest.fixture
def unique_tokens(tmp_path):
    """50 documents of 1..40 tokens whose ids are their global positions (all distinct)."""
    lengths = np.random.RandomState(0).randint(1, 41, size=50)
    ids = np.arange(lengths.sum())
    documents = [[chunk.tolist()] for chunk in np.split(ids, np.cumsum(lengths)[:-1])]
    return IndexedDataset(write_dataset(tmp_path / "unique", documents)), int(lengths.sum())


def test_an_epoch_predicts_every_token_exactly_once(unique_tokens, tmp_path):
    indexed, total = unique_tokens
    per_epoch = (total - 1) // SEQ
    dataset = GPTDataset(indexed, 3 * per_epoch - 5, SEQ, seed=7, cache_dir=str(tmp_path / "c"))
    assert len(dataset) == 3 * per_epoch  # whole epochs
    epochs = []
    for epoch in range(3):
        samples = [dataset[i]["tokens"] for i in range(epoch * per_epoch, (epoch + 1) * per_epoch)]
        assert all(s.dtype == np.int64 and s.shape == (SEQ + 1,) for s in samples)
        targets = np.concatenate([s[1:] for s in samples])
        assert len(np.unique(targets)) == len(targets) == per_epoch * SEQ  # never twice
        assert 1 <= total - len(targets) <= SEQ  # only the first token and a short tail are left
        epochs.append([s.tolist() for s in samples])
    assert epochs[0] != epochs[1]  # each epoch has its own document and sample order


def test_samples_are_windows_of_the_shuffled_document_stream(unique_tokens, tmp_path):
    indexed, _ = unique_tokens
    dataset = GPTDataset(indexed, 10, SEQ, seed=3, cache_dir=str(tmp_path))
    stream = np.concatenate([indexed[int(d)] for d in dataset.document_index[:len(indexed)]])
    for sample in range(len(dataset)):
        k = np.flatnonzero(dataset.shuffle_index == sample)[0]
        assert dataset[k]["tokens"].tolist() == stream[sample * SEQ: sample * SEQ + SEQ + 1].tolist()


def test_deterministic_in_seed(unique_tokens, tmp_path):
    indexed, _ = unique_tokens

    def samples(seed, cache):
        dataset = GPTDataset(indexed, 50, SEQ, seed=seed, cache_dir=str(tmp_path / cache))
        return [dataset[i]["tokens"].tolist() for i in range(len(dataset))]

    assert samples(1, "a") == samples(1, "b")
    assert samples(1, "a") != samples(2, "a")


def test_indices_are_cached_and_reused(unique_tokens, tmp_path, monkeypatch):
    indexed, _ = unique_tokens
    cache = tmp_path / "cache"
    first = GPTDataset(indexed, 40, SEQ, seed=5, name="valid", cache_dir=str(cache))
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 4 and all(f.startswith("GPTDataset-valid-") for f in files)

    def fail(*args, **kwargs):
        raise AssertionError("the cached indices should have been loaded")

    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", fail)
    again = GPTDataset(indexed, 40, SEQ, seed=5, name="valid", cache_dir=str(cache))
    assert [again[i]["tokens"].tolist() for i in range(5)] == [first[i]["tokens"].tolist()
                                                               for i in range(5)]
    with pytest.raises(AssertionError):  # other parameters, other cache file
        GPTDataset(indexed, 40, SEQ, seed=6, name="valid", cache_dir=str(cache))


def test_default_cache_is_next_to_the_data_and_split_subsets(unique_tokens):
    indexed, _ = unique_tokens
    subset = np.arange(10, 20)
    dataset = GPTDataset(indexed, 5, 4, seed=0, name="test", sequence_ids=subset)
    allowed = set(np.concatenate([indexed[i] for i in subset]).tolist())
    assert all(set(dataset[i]["tokens"].tolist()) <= allowed for i in range(len(dataset)))
    cache = os.path.join(os.path.dirname(indexed.prefix), "cache")
    assert any(name.startswith("GPTDataset-test-") for name in os.listdir(cache))


def test_too_little_data_is_a_clear_error(tmp_path):
    indexed = IndexedDataset(write_dataset(tmp_path / "small", [[[1, 2, 3]], [[4, 5]]]))
    with pytest.raises(ValueError, match=r"the train split of .*small has 5 tokens, fewer than "
                                         r"--seq-length \+ 1 = 9"):
        GPTDataset(indexed, 10, 8, seed=0, cache_dir=str(tmp_path))


def test_eod_mask_loss_leaves_out_the_first_target_of_each_document(tmp_path):
    """--eod-mask-loss: a sample's loss_mask is 0 exactly where the input is the end-of-document
    token, i.e. at the target that starts the next document, and 1 everywhere else."""
    eod = 10_000
    lengths = np.random.RandomState(1).randint(1, 30, size=40)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    documents = [[list(range(start, start + n)) + [eod]] for start, n in zip(starts, lengths)]
    indexed = IndexedDataset(write_dataset(tmp_path / "eod", documents))
    plain = GPTDataset(indexed, 30, SEQ, seed=5, cache_dir=str(tmp_path))
    masked = gpt_dataset.DocumentBoundaries(plain, eod, loss_mask=True)
    assert len(masked) == len(plain)
    document_starts, masked_targets = set(starts.tolist()), 0
    for i in range(len(masked)):
        sample = masked[i]
        tokens, mask = sample["tokens"], sample["loss_mask"]
        assert np.array_equal(tokens, plain[i]["tokens"]) and set(sample) == {"tokens", "loss_mask"}
        assert mask.dtype == np.float32 and mask.shape == (SEQ,)
        assert np.array_equal(mask == 0, tokens[:-1] == eod)
        assert all(int(target) in document_starts for target in tokens[1:][mask == 0])
        masked_targets += int((mask == 0).sum())
    assert masked_targets > 0


def test_document_boundaries_of_a_hand_made_sample():
    eod = 99
    sample = {"tokens": np.array([5, 6, eod, 7, 8, 9, eod, 10, 11])}  # inputs: all but the last
    boundaries = gpt_dataset.DocumentBoundaries([sample], eod, loss_mask=True, position_ids=True,
                                                document_ids=True)
    result = boundaries[0]
    assert result["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1, 0, 1]
    assert result["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert result["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]  # eod ends its document
    assert result["position_ids"].dtype == result["document_ids"].dtype == np.int64
    assert np.array_equal(result["tokens"], sample["tokens"])
    only_positions = gpt_dataset.DocumentBoundaries([sample], eod, position_ids=True)[0]
    assert set(only_positions) == {"tokens", "position_ids"}
