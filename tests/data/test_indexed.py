import os
import pickle
import struct

import numpy as np
import pytest

from megatron_2bw.data.indexed import (DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder,
                                       token_dtype)
from tests.data.helpers import write_dataset

DOCUMENTS = [[[1, 2, 3]], [[4, 5], [6]], [[7, 8, 9, 10]]]  # the second document has two sequences


@pytest.mark.parametrize("dtype, big_id", [(np.uint16, 65_000), (np.int32, 1_000_000)])
def test_round_trip(tmp_path, dtype, big_id):
    documents = DOCUMENTS + [[[big_id, 0]]]
    dataset = IndexedDataset(write_dataset(tmp_path / "d", documents, dtype))
    assert dataset.dtype == np.dtype(dtype)
    assert len(dataset) == 5 and dataset.num_documents == 4
    assert dataset.sequence_lengths.tolist() == [3, 2, 1, 4, 2]
    assert dataset.document_indices.tolist() == [0, 1, 3, 4, 5]
    assert [dataset[i].tolist() for i in range(5)] == [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10],
                                                        [big_id, 0]]
    assert dataset.get(3, offset=1, length=2).tolist() == [8, 9]
    assert dataset.get(3, offset=2).tolist() == [9, 10]
    assert dataset.max_token() == big_id and dataset.num_tokens == 12
    with pytest.raises(IndexError):
        dataset.get(0, offset=2, length=5)
    # DataLoader workers receive the dataset pickled: only the prefix travels, not the tokens
    state = pickle.dumps(dataset)
    assert len(state) < 200 and pickle.loads(state)[3].tolist() == [7, 8, 9, 10]


def test_idx_layout_byte_by_byte(tmp_path):
    """Megatron-LM's layout: magic, version, dtype code, counts, lengths, pointers, doc indices."""
    prefix = write_dataset(tmp_path / "d", DOCUMENTS, np.uint16)
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                + struct.pack("<Q", 4) + struct.pack("<Q", 4)
                + struct.pack("<4i", 3, 2, 1, 4)
                + struct.pack("<4q", 0, 6, 10, 12)  # byte offsets of 2-byte tokens
                + struct.pack("<4q", 0, 1, 3, 4))
    assert open(prefix + ".idx", "rb").read() == expected
    assert open(prefix + ".bin", "rb").read() == np.arange(1, 11, dtype="<u2").tobytes()


def test_dtype_codes_and_choice():
    assert DTYPE_CODES[np.uint16] == 8 and DTYPE_CODES[np.int32] == 4 and DTYPE_CODES[np.uint8] == 1
    assert token_dtype(32_000) == np.uint16 and token_dtype(65_499) == np.uint16
    assert token_dtype(65_500) == np.int32 and token_dtype(128_256) == np.int32


def _corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_bad_files_give_errors_naming_the_file(tmp_path):
    prefix = write_dataset(tmp_path / "d", DOCUMENTS)
    with pytest.raises(FileNotFoundError, match="missing.idx"):
        IndexedDataset(str(tmp_path / "missing"))

    os.rename(prefix + ".bin", prefix + ".bin.away")
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        IndexedDataset(prefix)
    os.rename(prefix + ".bin.away", prefix + ".bin")

    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 4)
    with pytest.raises(ValueError, match=r"d\.bin has 36 bytes but .*40 bytes.*truncated"):
        IndexedDataset(prefix)

    prefix = write_dataset(tmp_path / "v", DOCUMENTS)
    _corrupt(prefix + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(ValueError, match=r"v\.idx has index version 2"):
        IndexedDataset(prefix)

    prefix = write_dataset(tmp_path / "m", DOCUMENTS)
    _corrupt(prefix + ".idx", 0, b"NOTMAGIC!")
    with pytest.raises(ValueError, match=r"m\.idx is not a Megatron indexed-dataset index"):
        IndexedDataset(prefix)

    prefix = write_dataset(tmp_path / "t", DOCUMENTS)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(40)
    with pytest.raises(ValueError, match=r"t\.idx is truncated"):
        IndexedDataset(prefix)


def test_builder_writes_nothing_final_until_finalize_and_cleans_up_on_error(tmp_path):
    prefix = str(tmp_path / "out")
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix, np.uint16) as builder:
            builder.add_document(np.array([1, 2, 3]), [3])
            assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []

    builder = IndexedDatasetBuilder(prefix, np.uint16)
    with pytest.raises(ValueError, match="do not fit the uint16"):
        builder.add_document(np.array([70_000]), [1])
    with pytest.raises(ValueError, match="inconsistent"):
        builder.add_document(np.array([1, 2]), [3])
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_add_index_concatenates(tmp_path):
    a = write_dataset(tmp_path / "a", DOCUMENTS[:2], np.uint16)
    b = write_dataset(tmp_path / "b", DOCUMENTS[2:], np.uint16)
    with IndexedDatasetBuilder(str(tmp_path / "ab"), np.uint16) as builder:
        builder.add_index(a)
        builder.add_index(b)
        builder.finalize()
    whole = write_dataset(tmp_path / "whole", DOCUMENTS, np.uint16)
    for suffix in (".bin", ".idx"):
        assert open(str(tmp_path / "ab") + suffix, "rb").read() == open(whole + suffix, "rb").read()
    with IndexedDatasetBuilder(str(tmp_path / "mixed"), np.int32) as builder:
        with pytest.raises(ValueError, match="cannot merge"):
            builder.add_index(a)
