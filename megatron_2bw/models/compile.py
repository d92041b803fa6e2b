"""--torch-compile: each transformer layer compiled with torch.compile (in place, Module.compile).

2BW and PipeDream swap the Parameter objects a layer holds (WeightVersions.install) between the
versions of its weights. torch.compile inlines nn.Modules and lifts their parameters to graph
inputs (torch._dynamo.config.inline_inbuilt_nn_modules, on by default since torch 2.5), guarding
on their shapes and dtypes, not on which tensor object is installed: every version of a layer
runs the same compiled graph, with no recompilation per swap. Where that setting is off, a swap
would recompile (or fall back to eager), so the flag is refused there. The memory tracker counts
the first microbatch of each shape eagerly (torch.compiler.set_stance, torch >= 2.6), so its
saved-tensor hooks are never traced into the graphs.

Only the layers are compiled: the embeddings, the head and the loss run eagerly (the
vocabulary-parallel cross entropy is a custom autograd function with collectives), and
recomputation's checkpoints and (with attention dropout) the RNG tracker's forks inside a layer
break its graph into pieces that each compile.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_2bw.config import ConfigError


def check_compile_supported() -> None:
    dynamo = getattr(torch, "_dynamo", None)
    # on by default since torch 2.6, and deprecated since: a torch without the setting inlines
    inlined = dynamo is not None and getattr(dynamo.config, "inline_inbuilt_nn_modules", True)
    if not inlined or not hasattr(torch.compiler, "set_stance"):
        raise ConfigError(f"--torch-compile needs torch >= 2.6 with "
                          f"torch._dynamo.config.inline_inbuilt_nn_modules on (torch "
                          f"{torch.__version__} here): the weight versions' parameter swaps "
                          f"would recompile the layers")


def compile_transformer_layers(model: nn.Module) -> int:
    """Compile every TransformerLayer of the stage in place; returns how many."""
    from megatron_2bw.models.transformer import TransformerLayer
    check_compile_supported()
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    # the layers share TransformerLayer.forward's code, whose compiled graphs dynamo caches up
    # to a limit (then it runs eagerly): room for two per layer, should guards tell them apart
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = max(limit, 2 * len(layers))
    for layer in layers:
        layer.compile()
    return len(layers)
