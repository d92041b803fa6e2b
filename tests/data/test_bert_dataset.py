import numpy as np
import pytest

from megatron_2bw.data.bert_dataset import BERTDataset, BertSampleSettings, BertSpecialTokens
from megatron_2bw.data.indexed import IndexedDataset
from tests.data.helpers import write_dataset

SPECIAL = BertSpecialTokens(pad=0, cls=1, sep=2, mask=3)
FIRST_ID = 10


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
    """400 documents of 1-8 sentences; token ids are distinct and increase through the corpus."""
    rng = np.random.RandomState(0)
    documents, next_id = [], FIRST_ID
    for _ in range(400):
        document = []
        for _ in range(rng.randint(1, 9)):
            length = rng.randint(3, 21)
            document.append(list(range(next_id, next_id + length)))
            next_id += length
        documents.append(document)
    prefix = write_dataset(tmp_path_factory.mktemp("bert") / "corpus_text_sentence", documents)
    return IndexedDataset(prefix), next_id


def _settings(vocab_size, **kwargs):
    return BertSampleSettings(seq_length=64, vocab_size=vocab_size, special=SPECIAL, **kwargs)


def test_sample_layout_order_prediction_and_masking_statistics(sentences, tmp_path):
    indexed, vocab_size = sentences
    dataset = BERTDataset(indexed, 4000, _settings(vocab_size), seed=11, cache_dir=str(tmp_path))
    assert len(dataset) >= 4000
    candidates = predicted = masked = unchanged = swapped = short = 0
    for i in range(4000):
        sample = dataset[i]
        assert {k: (v.dtype, v.shape) for k, v in sample.items()} == {
            "text": (np.int64, (64,)), "types": (np.int64, (64,)), "labels": (np.int64, (64,)),
            "loss_mask": (np.float32, (64,)), "padding_mask": (np.int64, (64,)),
            "is_random": (np.int64, ())}
        text, labels, real = sample["text"], sample["labels"], sample["padding_mask"] == 1
        length = int(real.sum())
        assert real[:length].all() and not real[length:].any() and (text[length:] == SPECIAL.pad).all()
        target = dataset.sample_map[i, 2]
        assert length <= target + 3  # truncated to the target, plus [CLS] and two [SEP]
        short += target < 61
        # [CLS] A [SEP] B [SEP]: types 0 up to the first [SEP], 1 through the second
        original = np.where(labels >= 0, labels, text)[:length]
        seps = np.flatnonzero(original == SPECIAL.sep)
        assert original[0] == SPECIAL.cls and seps.tolist() == [seps[0], length - 1] and seps[0] > 1
        assert sample["types"][:seps[0] + 1].tolist() == [0] * (seps[0] + 1)
        assert sample["types"][seps[0] + 1:length].tolist() == [1] * (length - seps[0] - 1)
        assert not sample["types"][length:].any()
        a, b = original[1:seps[0]], original[seps[0] + 1:length - 1]
        # ids increase through the corpus, so the order of A and B is visible
        assert bool(sample["is_random"]) == (a.min() > b.max())
        assert bool(sample["is_random"]) != (a.max() < b.min())
        swapped += int(sample["is_random"])
        # masking
        chosen = labels >= 0
        assert np.array_equal(chosen, sample["loss_mask"] == 1)
        assert not chosen[[0, seps[0], length - 1]].any() and not chosen[length:].any()
        candidates += length - 3
        predicted += chosen.sum()
        masked += (text[chosen] == SPECIAL.mask).sum()
        unchanged += (text[chosen] == labels[chosen]).sum()
    assert abs(predicted / candidates - 0.15) < 0.0015  # within 1% of 15%
    assert abs(masked / predicted - 0.8) < 0.01
    assert abs(unchanged / predicted - 0.1) < 0.01
    assert abs((predicted - masked - unchanged) / predicted - 0.1) < 0.01  # random ids
    assert abs(swapped / 4000 - 0.5) < 0.03
    assert 0.07 < short / 4000 < 0.15  # --short-seq-prob 0.1 draws shorter targets


def test_deterministic_and_cached(sentences, tmp_path):
    indexed, vocab_size = sentences
    first = BERTDataset(indexed, 200, _settings(vocab_size), seed=3, cache_dir=str(tmp_path))
    again = BERTDataset(indexed, 200, _settings(vocab_size), seed=3, cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("BERTDataset-train-*-sample_map.npy"))) == 1
    for i in (150, 0, 7):  # any access order
        assert all(np.array_equal(first[i][k], again[i][k]) for k in first[i])
    other = BERTDataset(indexed, 200, _settings(vocab_size), seed=4, cache_dir=str(tmp_path))
    assert not np.array_equal(first[0]["text"], other[0]["text"])


def test_documents_subset_and_no_binary_head(sentences, tmp_path):
    indexed, vocab_size = sentences
    documents = np.arange(100, 150)
    dataset = BERTDataset(indexed, 100, _settings(vocab_size, binary_head=False), seed=0,
                          cache_dir=str(tmp_path), document_ids=documents)
    low = indexed[int(indexed.document_indices[100])][0]
    high = indexed[int(indexed.document_indices[150]) - 1][-1]
    for i in range(len(dataset)):
        sample = dataset[i]
        original = np.where(sample["labels"] >= 0, sample["labels"], sample["text"])
        length = int(sample["padding_mask"].sum())
        body = original[1:length - 1]
        assert original[length - 1] == SPECIAL.sep and (body >= low).all() and (body <= high).all()
        assert not sample["types"].any() and sample["is_random"] == 0


def test_document_level_data_is_a_clear_error(tmp_path):
    prefix = write_dataset(tmp_path / "doc", [[list(range(10, 40))] for _ in range(5)])
    with pytest.raises(ValueError, match=r"doc \(train split\): no document has 2 or more "
                                         r"sentences.*--split-sentences"):
        BERTDataset(IndexedDataset(prefix), 10, _settings(100), seed=0, cache_dir=str(tmp_path))
