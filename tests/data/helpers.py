"""Helpers of the data tests: tool loading, generated text, small dataset writers."""
import importlib.util
import random
import sys
from pathlib import Path

import numpy as np

from megatron_2bw.data.indexed import IndexedDatasetBuilder

TOOLS = Path(__file__).resolve().parents[2] / "tools"
WORDS = ("the king queen lord lady sweet love night day death crown sword heart fair noble good "
         "speak hath doth thou thee thy mine honour grace blood war peace").split()


def load_tool(name: str):
    """Import tools/NAME.py as module NAME; tools/ goes on sys.path, which spawned worker
    processes inherit, so that they can import it too and unpickle its functions."""
    if name in sys.modules:
        return sys.modules[name]
    if str(TOOLS) not in sys.path:
        sys.path.append(str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def random_text(rng: random.Random, sentences: int) -> str:
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize()
                    + rng.choice(".!?") for _ in range(sentences))


def write_dataset(prefix, documents, dtype=np.int32) -> str:
    """documents: list of documents, each a list of sequences (lists of ids)."""
    with IndexedDatasetBuilder(str(prefix), dtype) as builder:
        for sequences in documents:
            builder.add_document(np.concatenate([np.asarray(s) for s in sequences]),
                                 [len(s) for s in sequences])
        builder.finalize()
    return str(prefix)
