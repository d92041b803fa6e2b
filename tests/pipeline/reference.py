"""An independent single-process implementation of PipeDream-2BW's update rule:
W(t+1) = W(t) - lr * grad f_t(W(t-1)), with W(-1) = W(0); Adam's moments see the stale gradient.
Without the delay, the same loop is vanilla training."""
from __future__ import annotations

import math

import torch

from megatron_2bw.models import build_stage_model
from megatron_2bw.optim.optimizer import build_torch_optimizer


def mean_of_microbatch_losses(model, microbatches: list[dict]) -> torch.Tensor:
    return sum(model(None, batch)[0] for batch in microbatches) / len(microbatches)


def delayed_update_reference(config, batches: int, feed, microbatches: int,
                             batch_loss=mean_of_microbatch_losses, delayed: bool = True) -> dict:
    """`batch_loss(model, microbatches)`: the loss of one batch; `delayed=False` gives vanilla
    training (every batch on the newest weights) for the same loop."""
    model = build_stage_model(config.model, None, 1, range(config.model.num_layers), True, True,
                              config.training.seed)
    names = [n for n, _ in model.named_parameters()]
    current = [p.detach().clone().requires_grad_() for p in model.parameters()]
    previous = [p.detach().clone() for p in current]  # W(t-1)
    optimizer = build_torch_optimizer(current, config.optimizer)
    for b in range(batches):
        stale = previous if b > 0 and delayed else current
        with torch.no_grad():
            for p, w in zip(model.parameters(), stale):
                p.copy_(w)
        model.zero_grad()
        batch_loss(model, [feed(b * microbatches + j) for j in range(microbatches)]).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        clip = config.optimizer.clip_grad
        if clip > 0 and norm > clip:
            grads = [g * (clip / (norm + 1e-6)) for g in grads]
        previous = [p.detach().clone() for p in current]
        for p, g in zip(current, grads):
            p.grad = g
        optimizer.step()
    return {n: p.detach() for n, p in zip(names, current)}
