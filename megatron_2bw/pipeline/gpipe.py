"""GPipe (Huang et al., NeurIPS 2019): every forward of a batch, then every backward, drained
after each batch; batch b uses version b. Holds all m microbatches' activations."""
from __future__ import annotations

from typing import Iterator

from megatron_2bw.pipeline.actions import (BACKWARD, FORWARD, Action, end_of_flushed_batch,
                                           with_transfers)


def gpipe_actions(stages: int, microbatches: int, batches: int, stage: int, first_batch: int = 0,
                  chunks: int = 1) -> Iterator[Action]:
    m = microbatches
    for b in range(first_batch, first_batch + batches):
        for kind in (FORWARD, BACKWARD):
            for k in range(b * m, (b + 1) * m):
                yield from with_transfers(kind, stages, stage, 1, k, 0, b)
        yield from end_of_flushed_batch(b)
