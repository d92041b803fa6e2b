"""The data-parallel gradient average started bucket by bucket during a batch's last backward
(Megatron-LM's and DDP's overlap of gradient reduction with the backward).

The flat gradient buffer is cut into buckets of --ddp-bucket-size elements, as reduce() cuts it.
During a stage's last backward of a batch each bucket's all-reduce starts as soon as every
parameter in it has its gradient (a post-accumulate-grad hook per working leaf), while the
backward computes the gradients of the layers before. reduce() starts the buckets still waiting
(parameters that got no gradient) and the updater waits for all of them where it waited before.
Every replica runs the same backward, so the all-reduces start in the same order everywhere and
average the same buckets: the result is exactly that of reducing after the backward.

It applies where the average is a plain all-reduce of the buffer: not with the distributed
optimizer (a reduce-scatter per region of the layout) and not where some gradients must first be
summed over the tensor-parallel group (ParamSpec.tensor_partial_grad).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.distributed.comm import all_reduce


class BackwardBucketReducer:
    def __init__(self, versions, group, bucket_elements: int):
        self.versions, self.group = versions, group
        total = versions.layout.total
        self.bounds = [(lo, min(lo + bucket_elements, total))
                       for lo in range(0, total, bucket_elements)]
        # the buckets each parameter's elements fall in, and how many parameters each bucket waits for
        self.buckets_of = [range(o // bucket_elements, (o + n - 1) // bucket_elements + 1)
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
        lo, hi = self.bounds[j]
        self._started[j] = True
        self._works.append(all_reduce(self.versions.main_grad_buffer[lo:hi], self.group,
                                      op=dist.ReduceOp.AVG, async_op=True))

    def finish(self) -> list:
        """Start the buckets still waiting; every bucket's work (disarmed)."""
        for j, started in enumerate(self._started):
            if not started:
                self._start(j)
        self.armed = False
        return self._works
