"""An independent single-process reference of the asynchronous pipelines' update rules.

One plain model in one process; each stage's parameters (its layers; the embeddings on the first,
the final norm and output layer on the last) read, for update k, the weight version the rule
names for that stage, and every update is applied to the newest weights:
    W_s(k+1) = W_s(k) - lr * g_s(k),  g_s(k) the gradient of batch k at the versions read.
The rules are written here from their definitions, not taken from the schedules' action lists:
- vanilla: version k (Flush, GPipe);
- 2bw: max(k-1, 0) on every stage (PipeDream-2BW);
- pipedream: max(k - (p-1-s), 0) on stage s (PipeDream's weight stashing);
- pipedream-vs: max(k - (p-1), 0) on every stage (PipeDream's vertical sync).
Adam's moments see the stale gradients. Clipping is by the global norm of update k's gradients, or
(clip="stage", plain PipeDream) by each stage's own."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_2bw.models import build_stage_model
from megatron_2bw.optim.optimizer import build_torch_optimizer


@dataclass(frozen=True)
class Read:
    """The versions one stage reads for one update: at the forward and at the backward."""
    forward: int
    backward: int


def _stashed(version: Callable[[int, int, int], int]) -> Callable[[int, int, int], Read]:
    """A weight-stashing rule: the backward reads the version its forward read."""
    return lambda k, s, p: Read(version(k, s, p), version(k, s, p))


RULES: dict[str, Callable[[int, int, int], Read]] = {  # (update k, stage s, stages p) -> Read
    "vanilla": _stashed(lambda k, s, p: k),
    "2bw": _stashed(lambda k, s, p: max(k - 1, 0)),
    "pipedream": _stashed(lambda k, s, p: max(k - (p - 1 - s), 0)),
    "pipedream-vs": _stashed(lambda k, s, p: max(k - (p - 1), 0)),
}


def mean_of_microbatch_losses(model, microbatches: list[dict]) -> torch.Tensor:
    return sum(model(None, batch)[0] for batch in microbatches) / len(microbatches)


def even_layer_stages(num_layers: int, stages: int) -> list[int]:
    """The stage of each layer for layer counts that divide evenly (the tests' layouts)."""
    assert num_layers % stages == 0, (num_layers, stages)
    return [layer * stages // num_layers for layer in range(num_layers)]


def _stage_of_parameter(name: str, layer_stages: list[int]) -> int:
    layer = re.match(r"transformer\.layers\.(\d+)\.", name)
    if layer:
        return layer_stages[int(layer.group(1))]
    if name.startswith("embedding."):
        return 0
    return max(layer_stages)  # final norm, output layer, the binary head


def per_stage_delay_reference(config, batches: int, feed, microbatches: int, rule: str,
                              stages: int = 1, layer_stages: list[int] | None = None,
                              clip: str = "global", batch_loss=mean_of_microbatch_losses,
                              history: list | None = None) -> dict:
    """Final weights (by name) after `batches` updates of `rule` (a RULES key) over `stages`
    stages; `layer_stages`: each layer's stage (default: even). `history`, if a list, receives
    every version's weights by name (version k at index k)."""
    model = build_stage_model(config.model, None, 1, range(config.model.num_layers), True, True,
                              config.training.seed)
    layer_stages = layer_stages or even_layer_stages(config.model.num_layers, stages)
    names = [n for n, _ in model.named_parameters()]
    stage_of = [_stage_of_parameter(n, layer_stages) for n in names]
    newest = [p.detach().clone().requires_grad_() for p in model.parameters()]
    versions = [[p.detach().clone() for p in newest]]  # versions[v]: W(v)
    optimizer = build_torch_optimizer(newest, config.optimizer, names)
    read = RULES[rule]
    for k in range(batches):
        reads = [read(k, s, stages) for s in range(stages)]
        if any(r.forward != r.backward for r in reads):
            raise ValueError(f"{rule}: the reference differentiates the weights its forward read")
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(versions[reads[stage_of[i]].forward][i])
        model.zero_grad()
        batch_loss(model, [feed(k * microbatches + j) for j in range(microbatches)]).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        groups = [list(range(len(grads)))] if clip == "global" else \
            [[i for i in range(len(grads)) if stage_of[i] == s] for s in range(stages)]
        limit = config.optimizer.clip_grad
        for group in groups:
            norm = math.sqrt(sum(float(grads[i].pow(2).sum()) for i in group))
            if limit > 0 and norm > limit:
                for i in group:
                    grads[i] = grads[i] * (limit / (norm + 1e-6))
        for p, g in zip(newest, grads):
            p.grad = g
        optimizer.step()
        versions.append([p.detach().clone() for p in newest])
    if history is not None:
        history.extend({n: w for n, w in zip(names, version)} for version in versions)
    return {n: p.detach() for n, p in zip(names, newest)}


def delayed_update_reference(config, batches: int, feed, microbatches: int,
                             batch_loss=mean_of_microbatch_losses, delayed: bool = True) -> dict:
    """PipeDream-2BW's rule W(t+1) = W(t) - lr * grad f_t(W(t-1)), W(-1) = W(0); `delayed=False`
    gives vanilla training for the same loop."""
    return per_stage_delay_reference(config, batches, feed, microbatches,
                                     "2bw" if delayed else "vanilla", batch_loss=batch_loss)
