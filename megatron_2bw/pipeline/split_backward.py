"""A stage's backward split into B (input gradient) and W (weight gradients): zero-bubble schedules.

B differentiates the stage's output with respect to its input only, keeping the graph, and records
the gradient arriving at each node where the input's path meets a weight's path; W later
differentiates from those nodes to the weights only, so it repeats none of B's work, and
accumulates into the weights' .grad as a whole backward would (hooks included). The nodes are
found with torch.distributed.pipelining's graph helpers, the ones its zero-bubble schedules use.
A stage without an input gradient to send (the pipeline's first stage) does nothing in B and
its whole backward in W.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc,
                                                     construct_reverse_graph, get_param_groups)


@dataclass
class _Group:
    """Weights and the nodes where their paths meet the input's, with B's gradients there."""
    weights: list[torch.Tensor]
    nodes: list
    grads: list = field(default_factory=list)


@dataclass
class PendingWeightGradient:
    """What W needs: the groups (after B), or the whole backward (a stage without input grad)."""
    groups: list[_Group] | None = None
    output: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None,
                   stage_input: torch.Tensor | None,
                   weights: list[torch.Tensor]) -> tuple[torch.Tensor | None,
                                                          PendingWeightGradient]:
    """B: the gradient of `stage_input` (None without one) and what W needs."""
    if stage_input is None:
        return None, PendingWeightGradient(output=output, grad_output=grad_output)
    weights = [w for w in weights if w.requires_grad]
    weight_of = {_get_grad_fn_or_grad_acc(w): w for w in weights}
    reverse = construct_reverse_graph([output.grad_fn])
    groups = [_Group([weight_of[node] for node in g["params"]], list(g["intermediates"]))
              for g in get_param_groups([_get_grad_fn_or_grad_acc(stage_input)], list(weight_of),
                                        reverse)]
    handles = []
    for group in groups:
        group.grads = [None] * len(group.nodes)
        for i, node in enumerate(group.nodes):
            handles.append(node.register_prehook(_recorder(group.grads, i)))
    try:
        (grad,) = torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return grad, PendingWeightGradient(groups=groups)


def _recorder(store: list, i: int):
    def hook(grad_outputs):
        store[i] = grad_outputs
    return hook


def backward_weight(pending: PendingWeightGradient) -> None:
    """W: accumulate the weights' gradients into their .grad."""
    if pending.groups is None:
        torch.autograd.backward(pending.output, pending.grad_output)
        return
    for group in pending.groups:
        edges, grads = [], []
        for node, node_grads in zip(group.nodes, group.grads):
            for i, grad in enumerate(node_grads or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        if not edges:
            continue
        # a node below another of the group gets B's gradient, not the sum through both again
        handles = [node.register_prehook(lambda _, saved=node_grads: saved)
                   for node, node_grads in zip(group.nodes, group.grads)] \
            if len(group.nodes) > 1 else []
        try:
            torch.autograd.backward(edges, grad_tensors=grads, inputs=group.weights)
        finally:
            for handle in handles:
                handle.remove()
