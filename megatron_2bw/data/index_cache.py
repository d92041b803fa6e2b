"""Build-once cache of a dataset's index arrays (.npy files named by a hash of their parameters).

Distributed training calls dataset construction on rank 0 first, waits at a barrier, then on the
other ranks, which find the arrays and memory-map them. Files are written under temporary names
and a description file is renamed into place last, so a reader never sees a half-written cache;
two processes building the same cache at once merely write identical files.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)


def cache_directory(data_prefix: str, cache_dir: str | None) -> str:
    """--data-cache-path if given, else a `cache` folder next to the data (as Megatron-LM does)."""
    return cache_dir or os.path.join(os.path.dirname(os.path.abspath(data_prefix)), "cache")


def fingerprint(array: np.ndarray) -> str:
    return hashlib.md5(np.ascontiguousarray(array).tobytes()).hexdigest()


def build_or_load(directory: str, kind: str, name: str, description: dict,
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Memory-map the arrays cached for `description`, or run `build` and cache its result."""
    text = json.dumps(description, sort_keys=True)
    stem = os.path.join(directory, f"{kind}-{name}-{hashlib.md5(text.encode()).hexdigest()}")
    marker = stem + "-description.json"
    if os.path.isfile(marker):
        with open(marker) as f:
            names = json.load(f)["arrays"]
        return {key: np.load(f"{stem}-{key}.npy", mmap_mode="r") for key in names}

    logger.info("building %s indices for %s (%s)", kind, name, text)
    arrays = build()
    try:
        os.makedirs(directory, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        for key, array in arrays.items():
            with open(f"{stem}-{key}.npy{tag}", "wb") as f:
                np.save(f, array)
            os.replace(f"{stem}-{key}.npy{tag}", f"{stem}-{key}.npy")
        with open(marker + tag, "w") as f:
            json.dump({"description": description, "arrays": list(arrays)}, f, indent=1)
        os.replace(marker + tag, marker)
    except OSError as error:
        raise OSError(f"cannot write the {kind} index cache in {directory} ({error}); "
                      f"point --data-cache-path at a writable directory") from error
    return arrays
