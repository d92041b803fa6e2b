"""Each transformer layer's measured forward and backward time on this stage (for repartitioning).

Hooks on the stage's layers mark when a layer's forward starts and ends, and, through hooks on
its input and output tensors, when the gradient reaches its output (its backward starts) and its
input (its backward ends, recomputation included). A forward run again inside a backward
(recomputation) is part of that backward, not another forward. The stage's own forward (embedding,
head) is the module's forward minus its layers'; its backward is counted as twice that.

On CUDA the marks are events read at the next drained point (no host synchronisation while the
pipeline runs); on CPU they are clock readings. Hooks observe, they change no value.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


@dataclass
class StageTimes:
    """Seconds per microbatch since the last reset: the median over the microbatches, so that a
    rank descheduled now and then (processors shared with other work) does not count as slow."""
    layer_forward_s: dict[int, float] = field(default_factory=dict)  # global layer index -> s
    layer_backward_s: dict[int, float] = field(default_factory=dict)
    stage_forward_s: float = 0.0  # the whole module's forward
    microbatches: int = 0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


class LayerTimes:
    """Hooks on a stage module (GPT/BERT's LanguageModelStage) that time its layers."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.clock = _Clock(device)
        self._handles = []
        self.reset()
        for name, layer in module.transformer.layers.items():
            self._handles += [layer.register_forward_pre_hook(self._before(int(name))),
                              layer.register_forward_hook(self._after(int(name)))]
        self._handles += [module.register_forward_pre_hook(self._stage_before),
                          module.register_forward_hook(self._stage_after)]

    def reset(self) -> None:
        self._forward: list[tuple[int, object, object]] = []  # (layer, start, end)
        self._backward_start: dict[tuple[int, int], object] = {}  # (layer, call) -> mark
        self._backward: list[tuple[int, object, object]] = []
        self._stage: list[tuple[object, object]] = []
        self._calls: dict[int, int] = {}
        self._open: dict[int, object] = {}
        self._stage_open = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    # -- hooks -----------------------------------------------------------------------------
    def _before(self, layer: int):
        def hook(module, args):
            if not module.training or _in_backward():
                return
            self._open[layer] = self.clock.now()
            x = args[0]
            if torch.is_tensor(x) and x.requires_grad:
                call = self._calls.get(layer, 0)

                def ended(grad, layer=layer, call=call):
                    start = self._backward_start.pop((layer, call), None)
                    if start is not None:
                        self._backward.append((layer, start, self.clock.now()))
                x.register_hook(ended)
        return hook

    def _after(self, layer: int):
        def hook(module, args, output):
            if layer not in self._open or _in_backward():
                return
            self._forward.append((layer, self._open.pop(layer), self.clock.now()))
            call = self._calls[layer] = self._calls.get(layer, 0) + 1
            if torch.is_tensor(output) and output.requires_grad:
                def started(grad, layer=layer, call=call - 1):
                    self._backward_start[(layer, call)] = self.clock.now()
                output.register_hook(started)
        return hook

    def _stage_before(self, module, args):
        if module.training:
            self._stage_open = self.clock.now()

    def _stage_after(self, module, args, output):
        if self._stage_open is not None:
            self._stage.append((self._stage_open, self.clock.now()))
            self._stage_open = None

    # -- reading ---------------------------------------------------------------------------
    def collect(self) -> StageTimes:
        """The medians since the last reset (at a drained point: every backward has ended)."""
        def medians(marks) -> dict[int, float]:
            calls: dict[int, list[float]] = {}
            for layer, start, end in marks:
                calls.setdefault(layer, []).append(self.clock.seconds(start, end))
            return {layer: _median(values) for layer, values in calls.items()}
        return StageTimes(medians(self._forward), medians(self._backward),
                          _median([self.clock.seconds(a, b) for a, b in self._stage]),
                          len(self._stage))
