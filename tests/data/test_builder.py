import numpy as np
import pytest

from megatron_2bw.config import Config
from megatron_2bw.data.builder import build_pretraining_datasets, parse_split
from megatron_2bw.data.blended import BlendedDataset
from megatron_2bw.data.bert_dataset import BERTDataset
from megatron_2bw.data.gpt_dataset import GPTDataset
from megatron_2bw.data.indexed import IndexedDataset
from megatron_2bw.data.tokenizers import NullTokenizer
from tests.data.helpers import write_dataset

TOKENIZER = NullTokenizer(5000)  # ids 0..4999, eod 5000


def _config(tmp_path, **data):
    config = Config()
    config.model.seq_length = 8
    config.data.data_cache_path = str(tmp_path / "cache")
    for key, value in data.items():
        setattr(config.data, key, value)
    return config


def _documents(first, count=100, length=12, sentences=1):
    """`count` documents with distinct ids starting at `first`."""
    ids = iter(range(first, first + count * length * sentences))
    return [[[next(ids) for _ in range(length)] for _ in range(sentences)] for _ in range(count)]


def _tokens(dataset, key="tokens"):
    return set(np.concatenate([dataset[i][key] for i in range(len(dataset))]).tolist())


def test_split_by_documents(tmp_path):
    prefix = write_dataset(tmp_path / "a", _documents(0))
    train, valid, test = build_pretraining_datasets(
        _config(tmp_path, data_path=[prefix], split="80,10,10"), TOKENIZER, (50, 10, 10))
    assert all(isinstance(d, GPTDataset) for d in (train, valid, test))
    assert len(train) >= 50 and len(valid) >= 10
    # documents 0-79 train, 80-89 valid, 90-99 test: disjoint token ranges
    assert max(_tokens(train)) < 80 * 12 <= min(_tokens(valid))
    assert max(_tokens(valid)) < 90 * 12 <= min(_tokens(test))
    # a split asked for no samples, or given no documents, is None
    _, valid, test = build_pretraining_datasets(
        _config(tmp_path, data_path=[prefix], split="100,0,0"), TOKENIZER, (50, 10, 0))
    assert valid is None and test is None
    assert parse_split("98/2") == [0.98, 0.02, 0.0]


def test_blend_of_two_prefixes(tmp_path):
    a = write_dataset(tmp_path / "a", _documents(0))
    b = write_dataset(tmp_path / "b", _documents(2000))
    train, valid, _ = build_pretraining_datasets(
        _config(tmp_path, data_path=["0.3", a, "0.7", b], split="90,10,0"), TOKENIZER, (1000, 50, 0))
    assert isinstance(train, BlendedDataset) and len(train) == 1000 and len(valid) == 50
    from_a = sum(int(train[i]["tokens"][0] < 2000) for i in range(1000))
    assert abs(from_a / 1000 - 0.3) < 0.003


def test_separate_train_valid_test_paths(tmp_path):
    a = write_dataset(tmp_path / "a", _documents(0, count=20))
    b = write_dataset(tmp_path / "b", _documents(2000, count=20))
    train, valid, test = build_pretraining_datasets(
        _config(tmp_path, train_data_path=[a], valid_data_path=[b]), TOKENIZER, (30, 10, 10))
    assert _tokens(train) <= set(range(240)) and _tokens(valid) <= set(range(2000, 2240))
    assert test is None


def test_errors_name_the_problem(tmp_path):
    prefix = write_dataset(tmp_path / "big_ids", [[[5, 6000, 7] * 4]] * 4)
    with pytest.raises(ValueError, match=r"big_ids\.bin contains token id 6000, but the tokenizer "
                                         r"\(NullTokenizer\) has only 5001 ids"):
        build_pretraining_datasets(_config(tmp_path, data_path=[prefix]), TOKENIZER, (5, 0, 0))
    with pytest.raises(ValueError, match="--data-path expects PREFIX or W1 PREFIX1"):
        build_pretraining_datasets(_config(tmp_path, data_path=["0.5", "a", "b"]), TOKENIZER, (5, 0, 0))
    with pytest.raises(ValueError, match="--split expects"):
        build_pretraining_datasets(_config(tmp_path, data_path=[prefix], split="a,b"), TOKENIZER,
                                   (5, 0, 0))
    with pytest.raises(FileNotFoundError, match=r"missing\.idx"):
        build_pretraining_datasets(_config(tmp_path, data_path=[str(tmp_path / "missing")]),
                                   TOKENIZER, (5, 0, 0))
    config = _config(tmp_path, data_path=[prefix])
    config.model.model_type = "bert"
    with pytest.raises(ValueError, match="NullTokenizer has no cls token"):
        build_pretraining_datasets(config, TOKENIZER, (5, 0, 0))


class _BertVocabulary(NullTokenizer):
    """NullTokenizer ids plus the four BERT special tokens at 0-3."""

    def __init__(self):
        super().__init__(5000)
        self._special_ids.update(pad=0, cls=1, sep=2, mask=3)


def test_bert_from_sentence_data(tmp_path):
    prefix = write_dataset(tmp_path / "s", _documents(10, count=50, length=6, sentences=4))
    config = _config(tmp_path, data_path=[prefix], split="9,1,0")
    config.model.model_type, config.model.seq_length = "bert", 16
    train, valid, test = build_pretraining_datasets(config, _BertVocabulary(), (40, 5, 0))
    assert isinstance(train, BERTDataset) and test is None
    assert train[0]["text"][0] == 1 and train[0]["text"].shape == (16,)
    assert max(_tokens(train, "labels")) < 10 + 45 * 24 <= min(_tokens(valid, "labels") - {-1})


@pytest.mark.parametrize("model_type", ["gpt", "bert"])
def test_mock_data(model_type):
    config = Config()
    config.model.model_type, config.model.seq_length, config.model.vocab_size = model_type, 32, 50
    config.data.mock_data = True
    train, valid, test = build_pretraining_datasets(config, None, (20, 4, 0))
    again, _, _ = build_pretraining_datasets(config, None, (20, 4, 0))
    assert len(train) == 20 and len(valid) == 4 and test is None
    key = "tokens" if model_type == "gpt" else "text"
    for i in (0, 19):
        assert all(np.array_equal(train[i][k], again[i][k]) for k in train[i])  # deterministic
        assert train[i][key].dtype == np.int64 and train[i][key].max() < 50
    assert not np.array_equal(train[0][key], valid[0][key])  # each split has its own data
    assert not np.array_equal(train[0][key], train[1][key])
    if model_type == "gpt":
        assert train[0]["tokens"].shape == (33,)
    else:
        assert set(train[0]) == {"text", "types", "labels", "loss_mask", "padding_mask", "is_random"}
        assert train[0]["text"][0] == 1 and train[0]["labels"].max() >= 4  # mock BERT ids 0-3


def test_vocabulary_check_reads_the_data_once(tmp_path, monkeypatch):
    prefix = write_dataset(tmp_path / "a", _documents(0, count=20))
    config = _config(tmp_path, data_path=[prefix])
    build_pretraining_datasets(config, TOKENIZER, (10, 0, 0))

    def fail(self, *args):
        raise AssertionError("the largest token id should come from the cache")

    monkeypatch.setattr(IndexedDataset, "max_token", fail)
    train, _, _ = build_pretraining_datasets(config, TOKENIZER, (10, 0, 0))
    assert len(train) >= 10


def test_document_flags_reach_every_split(tmp_path):
    ids = _documents(0, count=60, length=5)
    prefix = write_dataset(tmp_path / "docs", [[doc[0] + [TOKENIZER.eod]] for doc in ids])
    config = _config(tmp_path, data_path=[prefix], split="80,20,0", eod_mask_loss=True)
    train, valid, test = build_pretraining_datasets(config, TOKENIZER, (20, 4, 0))
    assert test is None
    for dataset in (train, valid):
        sample = dataset[0]
        assert np.array_equal(sample["loss_mask"] == 0, sample["tokens"][:-1] == TOKENIZER.eod)
        assert (sample["loss_mask"] == 0).any()  # 6-token documents in 9-token windows
    config.data.reset_position_ids = config.data.reset_attention_mask = True
    train, _, _ = build_pretraining_datasets(config, TOKENIZER, (20, 4, 0))
    assert set(train[0]) == {"tokens", "loss_mask", "position_ids", "document_ids"}
    config.data.eod_mask_loss = False
    train, _, _ = build_pretraining_datasets(config, TOKENIZER, (20, 4, 0))
    assert set(train[0]) == {"tokens", "position_ids", "document_ids"}
