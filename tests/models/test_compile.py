"""--torch-compile: 2BW's weight versions share each layer's compiled graph (a swap recompiles
nothing) and the compiled pipeline trains as the eager one. Compiling takes tens of seconds on
a small CPU, so these carry the `compile` marker, outside the default run (pytest.ini);
`make gpu-check` runs them, and `pytest -m compile` alone."""
import pytest
import torch

from megatron_2bw.distributed.forked import run_forked
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.training.segments import run_segment
from megatron_2bw.training.stage import build_stage
from tests.pipeline.harness import full_weights, gpt_feed, max_difference, rank_weights, tiny_config

pytestmark = pytest.mark.compile


def _train(rank: int, world: int, compiled: bool):
    import torch._dynamo
    torch._dynamo.config.error_on_recompile = True  # a recompilation per swap fails the run
    config = tiny_config(p=2, layers=2, optimizer="adam", lr=1e-3, global_batch=4)
    config.training.torch_compile = compiled
    layout = ParallelLayout(world, 1, 2, rank)
    layout.build_groups(10.0)  # a stage compiling its first forward keeps the other waiting
    results = []
    stage = build_stage(config, layout, torch.device("cpu"), None, on_step=results.append)
    run_segment(stage, 0, 4, gpt_feed(config, layout))
    return {**rank_weights(layout, stage),
            "results": [(r.batch, r.skipped, r.grad_norm, r.metrics) for r in results]}


def test_2bw_versions_share_the_compiled_layers_and_train_as_eager():
    eager = run_forked(2, _train, False, timeout=900)
    compiled = run_forked(2, _train, True, timeout=900)
    last_stage = -1  # the rank holding the loss
    for (batch, _, _, got), (_, _, _, want) in zip(compiled[last_stage]["results"],
                                                   eager[last_stage]["results"]):
        assert got["lm loss"] == pytest.approx(want["lm loss"], rel=1e-5), batch
    assert max_difference(full_weights(compiled), full_weights(eager), 101) < 1e-5
