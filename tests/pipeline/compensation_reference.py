"""An independent single-process implementation of the asynchronous schedules with delay
compensation: it keeps every master-weight snapshot W(0), W(1), ... and applies the rules of
pipeline/compensation.py literally. A parameter on stage s has delay tau_s (2BW: 1 everywhere;
PipeDream: p-1-s; vertical sync: p-1):

- batch b reads version max(b - tau_s, 0);
- none/dc: version v = W(v); predict: version v = W(v) + tau_s * (W(v) - W(v-1)), version 0 = W(0);
- dc (tau = 1): the clipped gradient g of batch b becomes g + lambda * g*g * (W(b) - W(b-1))
  (zero for b = 0);
- W(b+1) = optimizer step of W(b) with that gradient; clipping by the global norm, or by each
  stage's own (plain PipeDream);
- ef: u_b = that step's change; W(b+1) = W(b) + u_b + beta * (u_b - u_{b-1}), u_{-1} = 0;
- nesterov: the step starts from W(b) + gamma * (W(b) - W(b-1)) (W(-1) = W(0))."""
from __future__ import annotations

import math

import torch

from megatron_2bw.models import build_stage_model
from megatron_2bw.optim.optimizer import build_torch_optimizer
from tests.pipeline.reference import _stage_of_parameter, even_layer_stages, mean_of_microbatch_losses


def compensated_reference(config, batches: int, feed, microbatches: int, mode: str,
                          coefficient: float = 0.04, stages: int = 1, delay=lambda stage: 1,
                          clip_per_stage: bool = False) -> dict:
    """`delay(stage)`: tau of each of `stages` stages (even layer split); `coefficient`: dc's
    lambda, ef's beta or nesterov's gamma."""
    model = build_stage_model(config.model, None, 1, range(config.model.num_layers), True, True,
                              config.training.seed)
    names = [n for n, _ in model.named_parameters()]
    layer_stages = even_layer_stages(config.model.num_layers, stages)
    stage_of = [_stage_of_parameter(n, layer_stages) for n in names]
    tau = [delay(s) for s in stage_of]
    master = [p.detach().clone().requires_grad_() for p in model.parameters()]
    optimizer = build_torch_optimizer(master, config.optimizer, names)
    snapshots = [[w.detach().clone() for w in master]]  # W(0), W(1), ...
    last_step = [torch.zeros_like(w) for w in master]  # ef's u_{b-1}

    def version(i: int, v: int) -> torch.Tensor:
        if mode != "predict" or v == 0:
            return snapshots[v][i]
        return snapshots[v][i] + tau[i] * (snapshots[v][i] - snapshots[v - 1][i])

    for b in range(batches):
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(version(i, max(b - tau[i], 0)))
        model.zero_grad()
        mean_of_microbatch_losses(model, [feed(b * microbatches + j)
                                          for j in range(microbatches)]).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        clip = config.optimizer.clip_grad
        groups = [[i for i in range(len(grads)) if stage_of[i] == s] for s in range(stages)] \
            if clip_per_stage else [list(range(len(grads)))]
        for group in groups:
            norm = math.sqrt(sum(float(grads[i].pow(2).sum()) for i in group))
            if clip > 0 and norm > clip:
                for i in group:
                    grads[i] = grads[i] * (clip / (norm + 1e-6))
        if mode == "dc" and b > 0:
            grads = [g + coefficient * g * g * (w_new - w_read)
                     for g, w_new, w_read in zip(grads, snapshots[b], snapshots[b - 1])]
        for p, g in zip(master, grads):
            p.grad = g
        if mode == "nesterov" and b > 0:
            with torch.no_grad():
                for p, w_new, w_old in zip(master, snapshots[b], snapshots[b - 1]):
                    p.copy_(w_new + coefficient * (w_new - w_old))
        optimizer.step()
        if mode == "ef":
            with torch.no_grad():
                for i, (p, w) in enumerate(zip(master, snapshots[b])):
                    step = p - w
                    p.copy_(w + step + coefficient * (step - last_step[i]))
                    last_step[i] = step.clone()
        snapshots.append([w.detach().clone() for w in master])
    return {n: w for n, w in zip(names, snapshots[-1])}
