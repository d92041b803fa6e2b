"""The flat layout of a stage's weights and gradients: where each parameter lives in the flat
buffers (pipeline/weights.py), how they split into regions (the tied embeddings; the distributed
optimizer's buckets) and which part of each region a data-parallel rank owns."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_2bw.distributed.comm import all_gather_into_tensor, group_size


@dataclass(frozen=True)
class OwnedPart:
    """Elements [lo, hi) of a flattened parameter (lo == hi: none) that a rank owns; they start at
    `start` in its part of region `region`, at `position` in its whole shard (all its parts)."""
    lo: int
    hi: int
    region: int
    start: int
    position: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lives in a stage's flat buffers and which part this rank owns.

    The tied word embeddings form the first region and the other parameters the second, each padded
    to a multiple of `alignment` (the world size, which every data-parallel size divides), so the
    buffers split evenly into any d shards without being laid out again. Rank r of d owns the r-th
    d-th of every region: the first and the last stage then hold the same part of the tied
    embeddings, and their all-reduce pairs shard with shard.

    With `bucket_elements` (the distributed optimizer) the second region is cut further, after a
    parameter, into regions of at least that many elements (the last one may be smaller), as
    Megatron-LM's DistributedOptimizer lays out its buckets: each region is then a bucket whose
    reduce-scatter gives every rank its part of it, so a bucket can be reduced as soon as its
    parameters have their gradients (pipeline/overlap.py), and every parameter's part on a rank
    stays one contiguous piece.
    """
    offsets: tuple[int, ...]  # per parameter (the module's order): start in the flat buffers
    numels: tuple[int, ...]
    regions: tuple[tuple[int, int], ...]  # [start, end) of each non-empty region, padded
    shards: int = 1
    rank: int = 0

    @staticmethod
    def build(numels: list[int], tied: list[bool], alignment: int,
              bucket_elements: int | None = None) -> "FlatLayout":
        offsets = [0] * len(numels)
        regions, start = [], 0

        def close(end: int) -> int:
            end = start + -(-(end - start) // alignment) * alignment
            regions.append((start, end))
            return end

        for region_is_tied in (True, False):
            end = start
            for i, n in enumerate(numels):
                if tied[i] == region_is_tied:
                    offsets[i] = end
                    end += n
                    if not region_is_tied and bucket_elements and end - start >= bucket_elements:
                        start = end = close(end)
            if end > start:
                start = close(end)
        return FlatLayout(tuple(offsets), tuple(numels), tuple(regions))

    @property
    def total(self) -> int:
        return self.regions[-1][1] if self.regions else 0

    @property
    def owned(self) -> list[tuple[int, int]]:
        """[start, end) of this rank's part of each region."""
        parts = []
        for start, end in self.regions:
            size = (end - start) // self.shards
            parts.append((start + self.rank * size, start + (self.rank + 1) * size))
        return parts

    @property
    def shard_numel(self) -> int:
        return sum(end - start for start, end in self.owned)

    def owned_part(self, i: int) -> OwnedPart:
        """Which elements of parameter i this rank owns, and where they sit."""
        o, n = self.offsets[i], self.numels[i]
        position = 0
        for index, ((start, end), (a, b)) in enumerate(zip(self.regions, self.owned)):
            if start <= o < end:
                lo, hi = max(o, a), min(o + n, b)
                if lo >= hi:
                    return OwnedPart(0, 0, index, 0, position)
                return OwnedPart(lo - o, hi - o, index, lo - a, position + lo - a)
            position += b - a
        return OwnedPart(0, 0, 0, 0, 0)

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full flat tensor from every rank's shard (rank order)."""
        parts, position = [], 0
        for a, b in self.owned:
            parts.extend(shard[position:position + b - a] for shard in shards)
            position += b - a
        return torch.cat(parts)


def gather_shards(shard: torch.Tensor, layout: FlatLayout, group, dst: int | None):
    """The full flat tensor from every rank's equal-sized shard: on global rank `dst` in host
    memory (for a checkpoint), None on the other ranks; with `dst` None on every rank's device.

    To `dst` the shards stream one at a time through one shard-sized buffer on its device into
    host memory, so the full state never sits on one device (the point of sharding it)."""
    d = group_size(group)
    if dst is None:
        gathered = torch.empty(d * shard.numel(), dtype=shard.dtype, device=shard.device)
        all_gather_into_tensor(gathered, shard, group=group)
        return layout.unshard(list(gathered.chunk(d)))
    if dist.get_rank() != dst:
        dist.send(shard, dst, group=group)
        return None
    buffer, on_host = None, []
    for member in dist.get_process_group_ranks(group):
        if member == dst:
            on_host.append(shard.to("cpu", copy=True))
            continue
        buffer = torch.empty_like(shard) if buffer is None else buffer
        dist.recv(buffer, member, group=group)
        on_host.append(buffer.to("cpu", copy=True))
    return layout.unshard(on_host)
