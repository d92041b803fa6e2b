"""The data-parallel gradient average started bucket by bucket during a batch's last backward
(Megatron-LM's and DDP's overlap of gradient reduction with the backward).

Buckets: without the distributed optimizer the flat gradient buffer is cut into buckets of
--ddp-bucket-size elements, as reduce() cuts it, and each is all-reduced; with it, each region of
the flat layout is a bucket (FlatLayout cuts the buffer after a parameter into regions of about
--ddp-bucket-size elements, as Megatron-LM's DistributedOptimizer does) and each is
reduce-scattered, every rank keeping the average of its own part, as reduce() does per region.

During a stage's last backward of a batch (the last W passes where the backward is split) each
bucket's reduction starts as soon as every parameter in it has its gradient (a
post-accumulate-grad hook per working leaf), while the backward computes the gradients of the
layers before. reduce() starts the buckets still waiting (parameters that got no gradient) and
the updater waits for all of them where it waited before. Every replica runs the same backward,
so the reductions start in the same order everywhere and reduce the same buckets: the result is
exactly that of reducing after the backward.

Gradients that are summed over the tensor-parallel group as well (ParamSpec.tensor_partial_grad:
sequence-parallel norms, qk-layernorm) are averaged here like the others and summed once the
average is in (GradientUpdater._averaged): the two commute, so the sum need not wait for the
whole backward before the average starts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.distributed.comm import all_reduce, reduce_scatter_tensor


def bucket_bounds(versions, bucket_elements: int) -> list[tuple[int, int]]:
    """[lo, hi) of each bucket of the flat gradient buffer, in the order reduce() reduces them:
    the regions of a sharded layout, else slices of `bucket_elements`."""
    if versions.sharded:
        return list(versions.layout.regions)
    total = versions.layout.total
    return [(lo, min(lo + bucket_elements, total)) for lo in range(0, total, bucket_elements)]


def start_bucket_reduction(versions, group, j: int, lo: int, hi: int):
    """Start averaging bucket j ([lo, hi) of the buffer) over the data-parallel group: a
    reduce-scatter into this rank's part where sharded, else an all-reduce (async work)."""
    buffer = versions.main_grad_buffer
    if versions.sharded:
        a, b = versions.layout.owned[j]
        return reduce_scatter_tensor(buffer[a:b], buffer[lo:hi], op=dist.ReduceOp.AVG,
                                     group=group, async_op=True)
    return all_reduce(buffer[lo:hi], group, op=dist.ReduceOp.AVG, async_op=True)


class BackwardBucketReducer:
    def __init__(self, versions, group, bucket_elements: int):
        self.versions, self.group = versions, group
        self.bounds = bucket_bounds(versions, bucket_elements)
        # the buckets each parameter's elements fall in, and how many parameters each bucket waits for
        self.buckets_of = [[j for j, (lo, hi) in enumerate(self.bounds) if lo < o + n and o < hi]
                           for o, n in zip(versions.layout.offsets, versions.layout.numels)]
        self.parameters_in = [0] * len(self.bounds)
        for buckets in self.buckets_of:
            for j in buckets:
                self.parameters_in[j] += 1
        self.armed = False
        self._waiting: list[int] = []
        self._started: list[bool] = []
        self._works: list = []
        for copy in versions.working_copies():
            self.watch(copy)
        versions.new_copy_listeners.append(self.watch)

    def watch(self, copy) -> None:
        """Hook every leaf of a working copy (each copy's leaves are hooked once)."""
        for i, leaf in enumerate(copy):
            leaf.register_post_accumulate_grad_hook(self._gradient_ready(i))

    def arm(self) -> None:
        """The coming backward is the batch's last on this stage."""
        self.armed = True
        self._waiting = list(self.parameters_in)
        self._started = [False] * len(self.bounds)
        self._works = []

    def _gradient_ready(self, index: int):
        def hook(_leaf: torch.Tensor) -> None:
            if not self.armed:
                return
            for j in self.buckets_of[index]:
                self._waiting[j] -= 1
                if self._waiting[j] == 0:
                    self._start(j)
        return hook

    @torch.no_grad()
    def _start(self, j: int) -> None:
        self._started[j] = True
        self._works.append(start_bucket_reduction(self.versions, self.group, j, *self.bounds[j]))

    def finish(self) -> list:
        """Start the buckets still waiting; every bucket's work (disarmed)."""
        for j, started in enumerate(self._started):
            if not started:
                self._start(j)
        self.armed = False
        return self._works
