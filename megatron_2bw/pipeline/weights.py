"""Weight versions of one pipeline stage: fp32 master weights, the working-precision versions the
schedule's actions name, and the gradient-accumulation buffer.

- The optimizer owns the fp32 master weights, which always hold the newest version.
- A version is a working copy: one flat tensor in the working precision whose per-parameter views
  are the leaves autograd sees. `install(v)` puts version v's leaves into the module (swapping
  Parameter objects, never their storage), so a microbatch's backward differentiates exactly the
  weights its forward used.
- `create(v)` fills a copy from the master weights after a step. A stage holds at most
  `rule.live_versions` working copies (VersionRule in pipeline/schedules.py: 1 for Flush and GPipe,
  2 for 2BW, p - s on stage s of PipeDream, p under its vertical sync), allocated up front; a
  released version's storage is reused for the next one, so no schedule copies more than its
  rule needs. The optimizer state exists once, for the master (newest) weights.
- In fp32 with several versions (2BW, PipeDream) the master weights are the newest version's own
  working copy (sharded: this rank's part of it), not one more fp32 copy: `prepare_step` first moves them to the free copy (a
  copy pass, which the new version would cost anyway), unless the schedule has just released
  their own copy, which the step then updates in place (the last stage's case: no copy at all).
- Gradients of every version accumulate into one flat buffer (`main_grad_buffer`, views per
  parameter): the schedule reduces a batch's gradients before any backward of the next batch runs.
- With a single-version schedule and an fp32 buffer the master gradients are the buffer (its
  owned part, sharded), as Megatron-LM's main_grad: no backward runs between a batch's reduction
  and its step, which steps on the buffer; the updater zeroes it after the step. With fp32
  weights too, the master weights are the working weights: no copy at all.
- With more versions (2BW, PipeDream) the next batch's backwards accumulate into the buffer
  before the step has read the batch's gradients, so `take_gradients` moves them into separate
  master gradients (whole and fp32: the two trade storage; sharded, into the working copy that
  is free until the step, where they fit: `grads_in_free_copy`), leaving the buffer zeroed.
- `shard(group)` (the distributed optimizer) keeps only this rank's 1/d of the master weights and
  of their gradients; a new version is then assembled by an all-gather over the group (in place
  where the master weights are part of the copy: fp32), one per region, in the background and
  waited for where its parameters are first needed (pipeline/param_gather.py).

Every flat tensor shares one `FlatLayout` (pipeline/flat_layout.py), so copying, reducing and
gathering are whole-region operations.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from megatron_2bw.distributed.comm import all_gather_into_tensor, group_rank, group_size
from megatron_2bw.pipeline.flat_layout import FlatLayout, gather_shards
from megatron_2bw.pipeline.version_rules import VersionRule

class WorkingCopy(list):
    """The leaves of one working copy (what the module holds) and the flat tensor they view."""

    def __init__(self, leaves, flat: torch.Tensor):
        super().__init__(leaves)
        self.flat = flat


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class WeightVersions:
    """The weight versions of one stage under `rule` (or, shorter, `single_version`: True for
    Flush's rule, False for 2BW's)."""

    def __init__(self, module: nn.Module, working_dtype: torch.dtype, grad_dtype: torch.dtype,
                 single_version: bool | None = None, rule: VersionRule | None = None,
                 predicted_versions: bool = False, bucket_elements: int | None = None):
        """`predicted_versions`: a new version is filled from `version_source` (weight
        prediction, pipeline/compensation.py) rather than being the master weights, so the
        master weights keep a copy of their own also in fp32. `bucket_elements`: the flat
        buffers are laid out in buckets of about that many elements (FlatLayout; for the
        distributed optimizer)."""
        if rule is None:
            rule = VersionRule("flush" if single_version in (None, True) else "2bw")
        self.module = module
        self.working_dtype = working_dtype
        self.rule = rule
        self.capacity = rule.live_versions  # working copies held (at most)
        self.single_version = self.capacity == 1
        self.new_copy_listeners: list = []  # called with each working copy made from now on
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.specs = [p.spec for _, p in named]
        self.shapes = [p.shape for _, p in named]  # this rank's (tensor-parallel) shard of each
        self._slots = []
        for name in self.names:
            owner_name, _, attr = name.rpartition(".")
            self._slots.append((module.get_submodule(owner_name), attr))
        self.layout = FlatLayout.build([p.numel() for _, p in named],
                                       [s.tied for s in self.specs], _world_size(),
                                       bucket_elements)
        fp32 = working_dtype == torch.float32 and grad_dtype == torch.float32
        self.alias = self.single_version and fp32
        # the master gradients are (this rank's part of) the fp32 accumulation buffer, unless a
        # backward of the next batch accumulates before the step has read them (more versions)
        self.shared_grads = self.single_version and grad_dtype == torch.float32
        self.device = named[0][1].device
        self.data_group = None  # set by shard()
        self._gathers = None  # sharded: the new versions' all-gathers in flight
        self.main_grad_buffer = self._zeros(self.layout.total, grad_dtype)
        self.main_grads = self.param_views(self.main_grad_buffer)
        first = self._new_copy()
        with torch.no_grad():
            for leaf, (_, p) in zip(first, named):
                leaf.copy_(p)
        # the working copy the master weights are (fp32: Flush's one copy, 2BW's newest), or None
        self._master_copy: WorkingCopy | None = first if fp32 and not predicted_versions else None
        master_flat = first.flat if self._master_copy is not None else \
            first.flat.to(torch.float32, copy=True)
        # (region index, this rank's master region) -> what a new version's part is filled from
        self.version_source = lambda index, master: master
        master_grad_flat = self.main_grad_buffer if self.shared_grads else \
            self._zeros(self.layout.total, torch.float32)
        self.master_regions = [master_flat[a:b] for a, b in self.layout.owned]
        self.master = [nn.Parameter(view) for view in self.param_views(master_flat)]
        for m, spec in zip(self.master, self.specs):
            m.spec = spec
        self._point_master_grads_at(master_grad_flat)
        self.versions: dict[int, WorkingCopy] = {0: first}
        self._free: list[WorkingCopy] = []
        self._add_spare_copies()
        self.install(0)

    # -- flat storage ------------------------------------------------------------------------
    def _zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(shape)
                for o, n, shape in zip(self.layout.offsets, self.layout.numels, self.shapes)]

    def _new_copy(self) -> WorkingCopy:
        flat = self._zeros(self.layout.total, self.working_dtype)
        leaves = [nn.Parameter(view) for view in self.param_views(flat)]
        for i, (leaf, grad) in enumerate(zip(leaves, self.main_grads)):
            if grad.dtype == leaf.dtype:
                leaf.grad = grad  # autograd accumulates in place into the flat buffer
            else:  # e.g. bf16 weights with fp32 accumulation: add each microbatch's gradient
                leaf.register_post_accumulate_grad_hook(self._accumulate_into(i))
        copy = WorkingCopy(leaves, flat)
        for listener in self.new_copy_listeners:
            listener(copy)
        return copy

    def _accumulate_into(self, index: int):
        """A post-accumulate-grad hook adding parameter `index`'s gradient into the buffer (the
        buffer of the moment: where it trades storage with the master gradients, it moves)."""
        def hook(param: torch.Tensor) -> None:
            self.main_grads[index].add_(param.grad)
            param.grad = None
        return hook

    def _point_master_grads_at(self, flat: torch.Tensor) -> None:
        """The (unsharded) master gradients become views of `flat`."""
        self._master_grad_flat = flat
        self.master_grad_regions = [flat[a:b] for a, b in self.layout.owned]
        for m, g in zip(self.master, self.param_views(flat)):
            m.grad = g

    def _point_master_at(self, copy: WorkingCopy) -> None:
        """The master weights become views of this rank's part of working copy `copy`."""
        self._master_copy = copy
        self.master_regions = [copy.flat[a:b] for a, b in self.layout.owned]
        for m, view in zip(self.master, self._owned_views(self.master_regions)):
            m.data = view

    def averaged_grads(self) -> list[torch.Tensor]:
        """Each parameter's elements of the buffer that this rank averages over the replicas:
        all of them, or sharded the part it owns (flattened)."""
        return self._owned_views([self.main_grad_buffer[a:b] for a, b in self.layout.owned])

    def _owned_views(self, regions: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's elements in `regions` (this rank's part of every region): the whole
        parameter in its shape, or when sharded the part this rank owns, flattened."""
        views = []
        for i, shape in enumerate(self.shapes):
            part = self.layout.owned_part(i)
            view = regions[part.region][part.start:part.start + part.numel]
            views.append(view.view(shape) if not self.sharded else view)
        return views

    @property
    def master_follows_newest(self) -> bool:
        """fp32 2BW: the master weights are (this rank's part of) the newest version's working
        copy."""
        return not self.alias and self._master_copy is not None

    @torch.no_grad()
    def prepare_step(self) -> None:
        """Call before the optimizer steps. Where the master weights follow the newest version:
        while a live version still uses their copy, copy their part into the free one and move
        the master weights there, so that the step writes the new version and leaves that one
        intact; once the schedule has released their copy, the step updates it in place."""
        if self.alias:  # the step writes the one copy in place
            self.wait_gathers(self._master_copy)
        if not self.master_follows_newest:
            return
        copy = self._master_copy
        if any(c is copy for c in self.versions.values()):
            free = self._free.pop()
            self.wait_gathers(free)
            for a, b in self.layout.owned:  # sharded: create() gathers the other replicas' parts
                free.flat[a:b].copy_(copy.flat[a:b])
            self._point_master_at(free)
        else:
            self.wait_gathers(self._take_released_newest())  # the step writes it in place

    def _take_released_newest(self) -> WorkingCopy:
        """The newest version's copy, out of the free ones: the schedule has just released it
        (the last release appends it; where the master weights follow it, it is theirs)."""
        copy = self._master_copy if self.master_follows_newest else self._free[-1]
        self._free = [c for c in self._free if c is not copy]
        return copy

    @property
    def swaps_gradients(self) -> bool:
        """The buffer and the (separate, unsharded) master gradients trade storage instead of
        copying: both fp32 and whole (a 1/d shard cannot trade with the full buffer)."""
        return not self.shared_grads and not self.sharded and \
            self.main_grad_buffer.dtype == torch.float32

    @torch.no_grad()
    def take_gradients(self) -> None:
        """Move the buffer's (reduced) gradients into the master gradients and leave the buffer
        zeroed for the next batch. Where the two are alike (swaps_gradients) they trade storage:
        a zeroing pass instead of a copy and a zeroing pass, and the working leaves' .grad move
        to the new buffer (the master gradients were consumed by the previous step)."""
        if self.shared_grads:
            return
        if self.grads_in_free_copy:  # the copy the schedule has just released
            self._point_master_grad_shard_at(self._free_copy_as_fp32_shard())
        if not self.swaps_gradients:
            for grad, (a, b) in zip(self.master_grad_regions, self.layout.owned):
                grad.copy_(self.main_grad_buffer[a:b])
            self.main_grad_buffer.zero_()
            return
        gradients, buffer = self.main_grad_buffer, self._master_grad_flat
        buffer.zero_()
        self.main_grad_buffer, self.main_grads = buffer, self.param_views(buffer)
        for copy in self.working_copies():
            for leaf, grad in zip(copy, self.main_grads):
                if leaf.dtype == grad.dtype:  # else a hook adds into the buffer of the moment
                    leaf.grad = grad
        self._point_master_grads_at(gradients)

    def _add_spare_copies(self) -> None:
        """The working copies beyond the live ones, up to the rule's capacity (2BW's second,
        PipeDream's p - s - 1 more), allocated at start so the stage holds from the first step
        what it holds at its peak (and an out-of-memory shows at once)."""
        while self.distinct_versions + len(self._free) < self.capacity:
            self._free.append(self._new_copy())

    def working_copies(self) -> list[WorkingCopy]:
        """Every working copy held: the live versions' (newest first), then the free ones."""
        live = [self.versions[v] for v in sorted(self.versions, reverse=True)]
        return list({id(c): c for c in live}.values()) + self._free

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this object holds (for memory accounting, counted by storage)."""
        return ([c.flat for c in self.working_copies()] + [self.main_grad_buffer]
                + self.master_regions + self.master_grad_regions)

    # -- sharding (distributed optimizer) ------------------------------------------------------
    @property
    def sharded(self) -> bool:
        return self.layout.shards > 1

    @torch.no_grad()
    def shard(self, group) -> None:
        """Keep only this rank's part of the master weights and their gradients. Each master
        Parameter keeps its identity (the optimizer holds it) and now views the elements of the
        parameter this rank owns, flattened (all, some or none of them)."""
        if self.sharded:
            raise RuntimeError("the master weights are already sharded")
        unsharded = self.master_regions
        self.layout = dataclasses.replace(self.layout, shards=group_size(group),
                                          rank=group_rank(group))
        self.data_group = group
        self._master_grad_flat = None  # the full flat is dropped: each rank keeps its shard's
        owned = self.layout.owned
        sizes = [b - a for a, b in owned]
        if self._master_copy is not None:  # fp32: the master weights stay part of a working copy
            self.master_regions = [self._master_copy.flat[a:b] for a, b in owned]
        else:  # a separate fp32 shard
            self.master_regions = list(self._zeros(self.layout.shard_numel, torch.float32)
                                       .split(sizes))
            for (start, _), (a, b), region, full in zip(self.layout.regions, owned,
                                                        self.master_regions, unsharded):
                region.copy_(full[a - start:b - start])
        for m, weights in zip(self.master, self._owned_views(self.master_regions)):
            m.data = weights
        if self.shared_grads:  # the master gradients are the buffer's owned part
            self._point_master_grad_shard_at([self.main_grad_buffer[a:b] for a, b in owned])
        elif self.grads_in_free_copy:
            self._point_master_grad_shard_at(self._free_copy_as_fp32_shard(zero=True))
        else:
            self._point_master_grad_shard_at(list(
                self._zeros(self.layout.shard_numel, torch.float32).split(sizes)))
        from megatron_2bw.pipeline.param_gather import ParameterGathers
        self._gathers = ParameterGathers(self.module, self._slots, self.layout,
                                         lambda: self._installed)

    @property
    def grads_in_free_copy(self) -> bool:
        """Sharded, with several versions and master weights apart from the working copies: the
        master-gradient shard (4/d bytes per parameter) lives in a free working copy when it
        fits (2 bytes per parameter in fp16/bf16 at d >= 2). Every multi-version schedule
        leaves a copy free from a batch's reduction to its step (the copy of the version the
        batch read, released at its end), and that step fills it with the new version only
        after the optimizer has read the gradients."""
        return self.sharded and self.capacity > 1 and self._master_copy is None and \
            4 * self.layout.shard_numel <= self.working_dtype.itemsize * self.layout.total

    def _free_copy_as_fp32_shard(self, zero: bool = False) -> list[torch.Tensor]:
        """This rank's master-gradient regions in the first free working copy's storage
        (reinterpreted as fp32), once its all-gathers are in."""
        if not self._free:
            raise RuntimeError("no free working copy to hold the master gradients: the "
                               "schedule must release a batch's version before reducing it")
        copy = self._free[0]
        self.wait_gathers(copy)
        shard = torch.empty(0, dtype=torch.float32, device=self.device).set_(
            copy.flat.untyped_storage(), 0, (self.layout.shard_numel,))
        if zero:
            shard.zero_()
        return list(shard.split([b - a for a, b in self.layout.owned]))

    def _point_master_grad_shard_at(self, regions: list[torch.Tensor]) -> None:
        """The (sharded) master gradients become `regions`, this rank's part of each region."""
        self.master_grad_regions = regions
        for m, grad in zip(self.master, self._owned_views(regions)):
            m.grad = grad

    def wait_gathers(self, copy: WorkingCopy | None = None) -> None:
        """Wait for the all-gathers still filling `copy` (None: every copy): before anything
        but a forward reads or overwrites it."""
        if self._gathers is None:
            return
        for c in [copy] if copy is not None else self.working_copies():
            self._gathers.wait(c)

    @torch.no_grad()
    def _fill_from_master(self, copy: WorkingCopy) -> None:
        if self.sharded:  # every rank contributes its updated part
            for index, ((start, end), (a, b), master) in enumerate(zip(
                    self.layout.regions, self.layout.owned, self.master_regions)):
                source = copy.flat[a:b] if copy is self._master_copy else \
                    self.version_source(index, master).to(self.working_dtype)
                work = all_gather_into_tensor(_untracked(copy.flat[start:end]), source,
                                              group=self.data_group, async_op=True)
                self._gathers.add(copy, index, work, source)
        elif copy is not self._master_copy:  # else it is the master weights
            for index, ((a, b), master) in enumerate(zip(self.layout.owned, self.master_regions)):
                copy.flat[a:b].copy_(self.version_source(index, master))

    @torch.no_grad()
    def full_master(self, dst: int | None = None) -> list[torch.Tensor] | None:
        """The full fp32 master weights in parameter order. Sharded: a collective over the
        data-parallel group that gathers them on global rank `dst` (in host memory; on every
        rank's device if None) and returns None elsewhere; unsharded: the master tensors
        themselves."""
        if not self.sharded:
            return list(self.master)
        shard = torch.cat(self.master_regions)
        full = gather_shards(shard, self.layout, self.data_group, dst)
        return None if full is None else self.param_views(full)

    @torch.no_grad()
    def load_full_master(self, tensors: list[torch.Tensor]) -> None:
        """Set the master weights from full tensors (parameter order); each rank keeps its part."""
        for i, (m, full) in enumerate(zip(self.master, tensors)):
            part = self.layout.owned_part(i)
            m.copy_(full.reshape(-1)[part.lo:part.hi] if self.sharded else full)

    # -- versions ------------------------------------------------------------------------------
    @property
    def newest(self) -> int:
        return max(self.versions)

    @property
    def distinct_versions(self) -> int:
        return len({id(leaves) for leaves in self.versions.values()})

    def version_for_batch(self, batch: int) -> int:
        """The version a batch's forwards and backwards use on this stage (2BW: the one before
        last; PipeDream: p - 1 - s before the newest)."""
        return self.rule.version_for_batch(batch)

    def install(self, version: int) -> None:
        if version not in self.versions:
            raise RuntimeError(f"weight version {version} is not alive (alive: {sorted(self.versions)})")
        self._installed = self.versions[version]
        if self._gathers is not None and self._gathers.wait_at_install:
            self._gathers.wait(self._installed)
        for (owner, attr), leaf in zip(self._slots, self._installed):
            owner._parameters[attr] = leaf

    def release(self, version: int) -> None:
        copy = self.versions.pop(version)
        if all(other is not copy for other in self.versions.values()):
            self._free.append(copy)

    def create(self, version: int, skipped: bool = False) -> None:
        """Version `version` from the master weights; for a skipped step, the newest copy (the
        master weights did not change), also when the schedule has just released it."""
        if skipped:
            copy = self.versions[self.newest] if self.versions else self._take_released_newest()
        elif self.master_follows_newest:  # prepare_step took it out of the free copies
            copy = self._master_copy
            self._fill_from_master(copy)  # sharded: the other replicas' parts
        else:
            if self._free:
                copy = self._free.pop()
            else:  # alias: the one copy is the master weights
                copy = self.versions[self.newest] if self.alias else self._new_copy()
            self.wait_gathers(copy)
            self._fill_from_master(copy)
        self.versions[version] = copy

    @torch.no_grad()
    def reset(self, newest: int, saved: dict[int, list[torch.Tensor]] | None = None) -> None:
        """Re-create the versions after the master weights were loaded: the saved working tensors
        of each version (a checkpoint's stashed versions), or version `newest` from the master.
        The working copies are reused, not allocated again."""
        self.wait_gathers()
        pool = list({id(c): c for c in self.versions.values()}.values()) + self._free
        self.versions, self._free = {}, []
        if self.alias:
            self._fill_from_master(pool[0])
            self.versions[newest] = pool[0]
        else:
            # where the master weights are a working copy, it holds the newest version
            keep = self._master_copy
            pool = [c for c in pool if c is not keep]
            for version, tensors in sorted((saved or {}).items()):
                copy = keep if version == newest and keep is not None else \
                    (pool.pop() if pool else self._new_copy())
                for leaf, tensor in zip(copy, tensors):
                    leaf.copy_(tensor)
                self.versions[version] = copy
            if newest not in self.versions:
                copy = keep if keep is not None else (pool.pop() if pool else self._new_copy())
                self._fill_from_master(copy)
                self.versions[newest] = copy
            self._free = pool
            self._add_spare_copies()
        self.install(self.newest)


def _untracked(view: torch.Tensor) -> torch.Tensor:
    """The same memory without the version counter the working leaves share with their flat
    tensor: an in-place collective bumps its output's counter when it is waited for, which for a
    region gathered while the version's earlier regions are in use would fail their backward
    (nothing reads a region before its wait: pipeline/param_gather.py)."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
