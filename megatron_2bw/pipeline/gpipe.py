"""GPipe (Huang et al., NeurIPS 2019): every forward of a batch, then every backward, drained
after each batch; batch b uses version b. Holds all m microbatches' activations."""
from __future__ import annotations

from typing import Iterator

from megatron_2bw.pipeline.actions import BACKWARD, FORWARD, Action, flushed_batches


def gpipe_actions(stages: int, microbatches: int, batches: int, stage: int, first_batch: int = 0,
                  chunks: int = 1) -> Iterator[Action]:
    order = [(kind, 0, j) for kind in (FORWARD, BACKWARD) for j in range(microbatches)]
    yield from flushed_batches(order, stages, stage, 1, microbatches, batches, first_batch)
