"""An independent single-process implementation of 2BW with delay compensation: it keeps every
master-weight snapshot W(0), W(1), ... and applies the rules of pipeline/compensation.py literally.

- batch b reads version max(b-1, 0);
- none/dc: version v = W(v); predict: version v = W(v) + s * (W(v) - W(v-1)), version 0 = W(0);
- dc: the clipped gradient g of batch b becomes g + lambda * g*g * (W(b) - W(b-1)) (zero for b = 0);
- W(b+1) = optimizer step of W(b) with that gradient."""
from __future__ import annotations

import math

import torch

from megatron_2bw.models import build_stage_model
from megatron_2bw.optim.optimizer import build_torch_optimizer
from tests.pipeline.reference import mean_of_microbatch_losses


def compensated_reference(config, batches: int, feed, microbatches: int, mode: str,
                          dc_lambda: float = 0.04, scale: float = 1.0) -> dict:
    model = build_stage_model(config.model, None, 1, range(config.model.num_layers), True, True,
                              config.training.seed)
    names = [n for n, _ in model.named_parameters()]
    master = [p.detach().clone().requires_grad_() for p in model.parameters()]
    optimizer = build_torch_optimizer(master, config.optimizer)
    snapshots = [[w.detach().clone() for w in master]]  # W(0), W(1), ...

    def version(v: int) -> list[torch.Tensor]:
        if mode != "predict" or v == 0:
            return snapshots[v]
        return [w + scale * (w - w_prev) for w, w_prev in zip(snapshots[v], snapshots[v - 1])]

    for b in range(batches):
        with torch.no_grad():
            for p, w in zip(model.parameters(), version(max(b - 1, 0))):
                p.copy_(w)
        model.zero_grad()
        mean_of_microbatch_losses(model, [feed(b * microbatches + j)
                                          for j in range(microbatches)]).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        clip = config.optimizer.clip_grad
        if clip > 0 and norm > clip:
            grads = [g * (clip / (norm + 1e-6)) for g in grads]
        if mode == "dc" and b > 0:
            grads = [g + dc_lambda * g * g * (w_new - w_read)
                     for g, w_new, w_read in zip(grads, snapshots[b], snapshots[b - 1])]
        for p, g in zip(master, grads):
            p.grad = g
        optimizer.step()
        snapshots.append([w.detach().clone() for w in master])
    return {n: w for n, w in zip(names, snapshots[-1])}
