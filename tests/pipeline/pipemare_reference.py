"""An independent single-process reference of PipeMare's update rule (pipeline/pipemare.py).

One plain model in one process; the parameters of stage s (its layers; the embeddings on the first,
the final norm and output layer on the last) hold one weight per stage, W_s(b) after b updates.
Stage s of p runs w = p - 1 - s forwards ahead of its backwards (1F1B) and updates after every
m backwards, so microbatch k of batch b = k // m meets, on stage s:
- at its forward, the weights after the updates of the batches whose m backwards were all done
  before it: the forward of k follows k - w backwards, so version max((k - w) // m, 0);
- at its backward, W_s(b) (every earlier batch's update is done), or with T2 the prediction
  W_s(b) - d * delta_s, d = b - the forward's version.
Its gradient takes the forward's activations and the backward's weights: the backward weights are
written into the parameters' storage between the forward and the backward, so that autograd's
saved parameters read them. Per stage: the gradient of the batch (mean over its microbatches) is
clipped by the stage's own norm; T1 scales the rate by 1 / tau^(1 - min(b / K, 1)) with
tau = ceil(w / m) (when >= 1); T2 updates delta_s <- g delta_s + (1 - g)(W_s(b+1) - W_s(b)),
g = D^(1/tau)."""
from __future__ import annotations

import math

import torch

from megatron_2bw.models import build_stage_model
from megatron_2bw.optim.optimizer import build_torch_optimizer
from tests.pipeline.reference import _stage_of_parameter, even_layer_stages


def pipemare_reference(config, batches: int, feed, microbatches: int, stages: int,
                       lr_warmup_iters: int = 0, discrepancy_decay: float = 0.0,
                       replicas: int = 1) -> dict:
    """Final weights by name after `batches` updates (one segment from batch 0). `replicas` d:
    each batch is m microbatches on each of d data-parallel replicas, `feed` numbering a batch's
    m * d microbatches as Megatron orders samples (microbatch j of replica r is j * d + r); the
    j-th of each replica meets the same weights."""
    m, opt = microbatches, config.optimizer
    model = build_stage_model(config.model, None, 1, range(config.model.num_layers), True, True,
                              config.training.seed)
    named = list(model.named_parameters())
    stage_of = [_stage_of_parameter(n, even_layer_stages(config.model.num_layers, stages))
                for n, _ in named]
    ahead = [stages - 1 - s for s in range(stages)]  # w: forwards before the first backward
    tau = [math.ceil(w / m) for w in ahead]
    weights = [p.detach().clone().requires_grad_() for _, p in named]  # W(b), per stage
    history = [[w.detach().clone() for w in weights]]  # W(0), W(1), ...
    delta = [torch.zeros_like(w) for w in weights]
    optimizers = []
    for s in range(stages):
        mine = [i for i in range(len(named)) if stage_of[i] == s]
        optimizers.append(build_torch_optimizer([weights[i] for i in mine], opt,
                                                [named[i][0] for i in mine]))
    for b in range(batches):
        for p in model.parameters():
            p.grad = None
        for j, r in [(j, r) for j in range(m) for r in range(replicas)]:
            k = b * m + j
            read = [max((k - ahead[s]) // m, 0) for s in range(stages)]
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.copy_(history[read[stage_of[i]]][i])
            loss = model(None, feed((b * m + j) * replicas + r))[0] / (m * replicas)
            with torch.no_grad():  # into the storage autograd saved: no version bump
                for i, p in enumerate(model.parameters()):
                    d = b - read[stage_of[i]]
                    p.data.copy_(weights[i] - d * delta[i] if discrepancy_decay > 0 else weights[i])
            loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        for s in range(stages):
            mine = [i for i in range(len(grads)) if stage_of[i] == s]
            norm = math.sqrt(sum(float(grads[i].pow(2).sum()) for i in mine))
            if 0 < opt.clip_grad < norm:
                for i in mine:
                    grads[i] = grads[i] * (opt.clip_grad / (norm + 1e-6))
            factor = 1.0
            if lr_warmup_iters > 0 and tau[s] >= 1:
                factor = tau[s] ** -(1.0 - min(b / lr_warmup_iters, 1.0))
            for group in optimizers[s].param_groups:
                group["lr"] = opt.lr * factor
        for w, g in zip(weights, grads):
            w.grad = g
        for optimizer in optimizers:
            optimizer.step()
        with torch.no_grad():
            for i, w in enumerate(weights):
                t = tau[stage_of[i]]
                gamma = discrepancy_decay ** (1.0 / t) if t >= 1 and discrepancy_decay > 0 else 0.0
                delta[i] = gamma * delta[i] + (1.0 - gamma) * (w - history[-1][i])
        history.append([w.detach().clone() for w in weights])
    return {n: w.detach() for (n, _), w in zip(named, weights)}
