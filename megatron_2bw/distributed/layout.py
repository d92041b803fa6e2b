"""The one named process layout: world = t (tensor) x d (data) x p (pipeline).

Rank order puts tensor-parallel ranks closest, then data-parallel replicas, then pipeline stages:
rank = pp * (d * t) + dp * t + tp, so a stage's t x d ranks are contiguous (one server when
t * d <= devices per node) and pipeline p2p is the only traffic that crosses servers.

Context parallelism (cp > 1) splits the d weight replicas further: dp = replica * cp + its part
of the sequence, so the cp ranks of a replica are neighbours (Megatron's order tp, cp, dp, pp).
They hold the same weights and reduce their gradients with the replicas (the "data" group has all
d ranks); they read the same samples (`data_replicas`, `sample_rank`) and split each sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Coordinates:
    tp: int
    dp: int
    pp: int


@dataclass
class ParallelLayout:
    world_size: int
    tensor: int
    pipeline: int
    rank: int = 0
    context: int = 1  # cp: ranks sharing each sequence
    groups: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.world_size % (self.tensor * self.pipeline * self.context):
            raise ValueError(f"world size {self.world_size} is not divisible by t={self.tensor} x "
                             f"p={self.pipeline} x cp={self.context}")

    @property
    def data(self) -> int:
        """Ranks holding the same weights (gradients are reduced over them): replicas x cp."""
        return self.world_size // (self.tensor * self.pipeline)

    @property
    def data_replicas(self) -> int:
        """Ranks reading different samples: the data-parallel degree of the batch."""
        return self.data // self.context

    @property
    def sample_rank(self) -> int:
        """This rank's data-parallel replica, which decides the samples it reads."""
        return self.coords.dp // self.context

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return pp * (self.data * self.tensor) + dp * self.tensor + tp

    def coordinates(self, rank: int | None = None) -> Coordinates:
        rank = self.rank if rank is None else rank
        pp, rest = divmod(rank, self.data * self.tensor)
        dp, tp = divmod(rest, self.tensor)
        return Coordinates(tp, dp, pp)

    @property
    def coords(self) -> Coordinates:
        return self.coordinates()

    @property
    def stage(self) -> int:
        return self.coords.pp

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline - 1

    def stage_rank(self, stage: int) -> int:
        """The rank holding the same tp/dp coordinates on another stage."""
        c = self.coords
        return self.rank_of(c.tp, c.dp, stage)

    def describe(self) -> str:
        c = self.coords
        return (f"rank {self.rank} (tp={c.tp}/{self.tensor}, dp={c.dp}/{self.data}, "
                f"pp={c.pp}/{self.pipeline})")

    # -- rank lists of every group kind ---------------------------------------------------------
    def group_ranks(self, kind: str) -> list[list[int]]:
        t, d, p = self.tensor, self.data, self.pipeline
        if kind == "tensor":
            return [[self.rank_of(x, dp, pp) for x in range(t)] for pp in range(p) for dp in range(d)]
        if kind == "data":
            return [[self.rank_of(tp, x, pp) for x in range(d)] for pp in range(p) for tp in range(t)]
        if kind == "pipeline":
            return [[self.rank_of(tp, dp, x) for x in range(p)] for dp in range(d) for tp in range(t)]
        if kind == "model":  # tensor x pipeline: everything one data-parallel replica holds
            return [[self.rank_of(tp, dp, pp) for pp in range(p) for tp in range(t)] for dp in range(d)]
        if kind == "context":  # the cp ranks splitting the sequences of one replica
            cp = self.context
            return [[self.rank_of(tp, replica * cp + x, pp) for x in range(cp)]
                    for pp in range(p) for replica in range(d // cp) for tp in range(t)]
        if kind == "embedding":  # first and last stage of each pipeline (tied word embeddings)
            return [sorted({self.rank_of(tp, dp, 0), self.rank_of(tp, dp, p - 1)})
                    for dp in range(d) for tp in range(t)]
        raise ValueError(f"unknown group kind {kind!r}")

    def build_groups(self, timeout_minutes: float) -> None:
        """Create every group (collective: all ranks call new_group for every group, same order)."""
        timeout = timedelta(minutes=timeout_minutes)
        kinds = ("tensor", "data", "pipeline", "model", "embedding") + \
            (("context",) if self.context > 1 else ())  # cp = 1: group("context") is None
        for kind in kinds:
            for ranks in self.group_ranks(kind):
                group = dist.new_group(ranks, timeout=timeout) if self.world_size > 1 else None
                if self.rank in ranks:
                    self.groups[kind] = group

    def group(self, kind: str):
        """The process group of this rank (None in a world of one: collectives are skipped)."""
        return self.groups.get(kind)
