"""The distributed optimizer's all-gather of a new weight version, kept off the next forward's
critical path (Megatron-LM's --overlap-param-gather).

After a step every rank holds its updated part of each region (bucket) of the flat layout; a new
version's working copy is assembled by one all-gather per region. They are started together,
asynchronously, and waited for region by region where the version's parameters are first needed:
a forward pre-hook on each module that holds parameters waits, in the layout's order, for every
region up to the last one holding that module's parameters. The layout follows the modules'
order, which is the order a forward uses them, so the first layers compute while the later
regions are still in flight. Waiting for every earlier region too keeps a weight read outside
its own module's call correct where it lies in an earlier region (the tied word embeddings,
region 0, which the last stage's head reads); a stage whose top module holds parameters itself
waits for all of them at its start.

Under 2BW and PipeDream a new version is first read a whole batch after the step that makes it
(the next batch reads the previous one), so its gather has that long to land; under Flush the
next forward's first layers overlap the rest. Compiled layers (--torch-compile) are not hooked
(a hook would be traced into their graphs): there the whole version is waited for when it is
installed. Anything else that reads or overwrites a working copy (the next step, a release, a
checkpoint, a reset) waits for its gathers first (WeightVersions.wait_gathers).
"""
from __future__ import annotations

import torch
from torch import nn


class ParameterGathers:
    """The all-gathers in flight per working copy, and the hooks that wait for them."""

    def __init__(self, module: nn.Module, slots: list[tuple[nn.Module, str]], layout,
                 installed):
        """`slots`: (owner module, attribute) of each parameter, in the layout's order;
        `installed()`: the working copy the module holds now."""
        self.installed = installed
        self._pending: dict[int, list] = {}  # id(copy) -> [(region, work, source)], in order
        compiled = any(getattr(m, "_compiled_call_impl", None) is not None
                       for m in module.modules())
        self.wait_at_install = compiled
        if compiled:
            return
        region_of = [_region_of(layout, i) for i in range(len(slots))]
        last_region: dict[nn.Module, int] = {}
        for (owner, _), region in zip(slots, region_of):
            last_region[owner] = max(last_region.get(owner, -1), region)
        for owner, region in last_region.items():
            owner.register_forward_pre_hook(self._hook(region))

    def add(self, copy, region: int, work, source: torch.Tensor) -> None:
        """A region's gather into `copy` is in flight (`source` kept alive until it lands)."""
        self._pending.setdefault(id(copy), []).append((region, work, source))

    def wait(self, copy, through: int | None = None) -> None:
        """Wait for `copy`'s gathers of regions up to `through` (None: all)."""
        pending = self._pending.get(id(copy))
        while pending and (through is None or pending[0][0] <= through):
            _, work, _ = pending.pop(0)
            work.wait()
        if not pending:
            self._pending.pop(id(copy), None)

    def _hook(self, region: int):
        def hook(_module, _args):
            if self._pending:
                self.wait(self.installed(), region)
        return hook


def _region_of(layout, i: int) -> int:
    offset = layout.offsets[i]
    return next(j for j, (start, end) in enumerate(layout.regions) if start <= offset < end)
