"""A pipeline rank's model chunks: under the interleaved schedule chunk c of rank r is virtual
stage c * p + r of the p * v; under a V (pipeline/placement.py) chunk 0 is virtual stage r and
chunk 1 virtual stage 2p - 1 - r. Each is a whole stage module over its range of layers.

The chunks are one module for the weight versions, the optimizer and checkpoints, under the
names a single stage's module would give (layers by their global index, the embeddings on the
first virtual stage, the heads on the last), so a checkpoint names the same parameters whatever
the chunking, and tools reshard it as any other.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn


class ModelChunks(nn.Module):
    def __init__(self, chunks: list[nn.Module], shape: str = "loop"):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.shape = shape  # the placement of the chunks (pipeline/placement.py)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for chunk in self.chunks:  # chunk by chunk, without the "chunks.c." prefix
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:
        """The module a parameter name (as named_parameters gives it) leads to ("": the chunk
        with parameters of its own, the last virtual stage's output layer)."""
        if not target:
            owners = [chunk for chunk in self.chunks if chunk._parameters]
            return owners[0] if len(owners) == 1 else self
        for chunk in self.chunks:
            try:
                return chunk.get_submodule(target)
            except AttributeError:
                continue
        raise AttributeError(f"no model chunk has a submodule {target!r}")

    def loss_tokens(self, batch: dict) -> torch.Tensor:
        return self.chunks[0].loss_tokens(batch)

    def forward(self, *args, **kwargs):
        raise RuntimeError("run a model chunk (ModelChunks.chunks[c]), not all of them at once")
