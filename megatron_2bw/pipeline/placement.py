"""Where the virtual stages of a pipeline sit: which rank and model chunk runs virtual stage v.

A model cut into p * v virtual stages runs on p ranks with v chunks each.
- "loop" (Megatron-LM's interleaved 1F1B): chunk c of rank r is virtual stage c * p + r, so a
  microbatch goes down the ranks v times, wrapping from the last rank to the first.
- "v" (ZB-V, DualPipeV, V-Half; two chunks): chunk 0 of rank r is virtual stage r and chunk 1 is
  virtual stage 2p - 1 - r. A microbatch goes down the ranks in chunk 0 and back up in chunk 1;
  the turn on the last rank stays on that rank (a local hand-off, not a transfer), and the first
  and the last virtual stage (the embedding and the output layer) both sit on rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass

SHAPES = ("loop", "v")


@dataclass(frozen=True)
class Placement:
    stages: int  # ranks of the pipeline
    chunks: int = 1  # model chunks per rank
    shape: str = "loop"

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise ValueError(f"unknown placement {self.shape!r}; expected one of {SHAPES}")
        if self.shape == "v" and self.chunks != 2:
            raise ValueError(f"a V placement holds 2 model chunks per rank, got {self.chunks}")

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        if self.shape == "v" and chunk == 1:
            return 2 * self.stages - 1 - stage
        return chunk * self.stages + stage

    def position(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) of a virtual stage."""
        if self.shape == "v" and virtual_stage >= self.stages:
            return 2 * self.stages - 1 - virtual_stage, 1
        return virtual_stage % self.stages, virtual_stage // self.stages

    def is_first(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == self.virtual_stages - 1

    def next(self, stage: int, chunk: int) -> tuple[int, int] | None:
        """(rank, chunk) that takes this chunk's activations; None after the last."""
        v = self.virtual_stage(stage, chunk)
        return None if v == self.virtual_stages - 1 else self.position(v + 1)

    def previous(self, stage: int, chunk: int) -> tuple[int, int] | None:
        """(rank, chunk) that takes this chunk's input gradients; None before the first."""
        v = self.virtual_stage(stage, chunk)
        return None if v == 0 else self.position(v - 1)

    def is_local(self, stage: int, neighbour: tuple[int, int] | None) -> bool:
        """Whether a hand-off to `neighbour` stays on the rank (the V's turn): no transfer."""
        return self.shape == "v" and neighbour is not None and neighbour[0] == stage
