"""The distributed optimizer's all-gather of a new weight version runs in the background and is
waited for region by region in the forwards that first read the version (pipeline/
param_gather.py): exactly the weights, norms and losses of gathering in the step, at
p = 2 x d = 2 for 2BW (fp32, where the master weights are part of the gathered copy, and bf16,
gathered from the fp32 shards), Flush, zb-h1 and PipeDream (p - s versions, an untied head)."""
import dataclasses

import pytest
import torch

from megatron_2bw.config import PrecisionConfig
from megatron_2bw.pipeline import param_gather
from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.flat_layout import FlatLayout
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, max_difference, tiny_config
from tests.pipeline.precision_harness import train_stage


def _train(rank: int, world: int, schedule: str, bf16: bool, in_background: bool):
    config = tiny_config(p=2, schedule=schedule, optimizer="adam", lr=1e-3, global_batch=8,
                         layers=4, untie_embeddings_and_output_weights=schedule == "pipedream")
    config = dataclasses.replace(
        config, precision=PrecisionConfig(bf16=bf16),
        parallel=dataclasses.replace(config.parallel, ddp_bucket_size=1000,
                                     use_distributed_optimizer=True))
    waited_in = []  # the kind of action during which each region's gather was waited for
    current = [None]
    add = param_gather.ParameterGathers.add

    class RecordedWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            waited_in.append(current[0])
            return self.work.wait()

    def recorded_add(self, copy, region, work, source):
        add(self, copy, region, RecordedWork(work), source)
        if not in_background:  # the synchronous path: waited for in the step that made it
            self.wait(copy)

    param_gather.ParameterGathers.add = recorded_add  # this forked rank's class

    def watch(stage):
        run_one = stage.executor._run_one

        def tracked(action, next_microbatch):
            current[0] = action.kind
            run_one(action, next_microbatch)
        stage.executor._run_one = tracked

    result = train_stage(rank, world, config, 4, before=watch)
    return {**result, "waited_in": waited_in}


@pytest.mark.parametrize("schedule, bf16", [("2bw", False), ("2bw", True), ("flush", False),
                                            ("zb-h1", False), ("pipedream", False)],
                         ids=["2bw-fp32", "2bw-bf16", "flush-fp32", "zb-h1-fp32",
                              "pipedream-fp32-untied"])
def test_version_gathered_in_the_background_equals_gathering_it_in_the_step(schedule, bf16):
    in_step = run_ranks(4, _train, schedule, bf16, False)
    background = run_ranks(4, _train, schedule, bf16, True)
    for r in in_step:
        assert r["waited_in"] and set(r["waited_in"]) == {S.STEP}
    for r in background:  # every gather waited for by a forward that reads the version
        assert r["waited_in"] and set(r["waited_in"]) == {S.FORWARD}, (r["coords"], r["waited_in"])
    assert max_difference(full_weights(background), full_weights(in_step), 101) == 0.0
    assert [r["results"] for r in background] == [r["results"] for r in in_step]


class _Work:
    def __init__(self, waited: list, region: int):
        self.waited, self.region = waited, region

    def wait(self):
        self.waited.append(self.region)


def _two_layers():
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(first, second)
    slots = [(first, "weight"), (first, "bias"), (second, "weight"), (second, "bias")]
    layout = FlatLayout.build([4, 2, 4, 2], [False] * 4, alignment=1, bucket_elements=6)
    assert layout.regions == ((0, 6), (6, 12))  # one region per layer
    return model, slots, layout


@pytest.mark.parametrize("called_first", [0, 1])
def test_a_module_waits_for_every_region_up_to_its_own_before_it_runs(called_first):
    model, slots, layout = _two_layers()
    copy, waited = object(), []
    gathers = param_gather.ParameterGathers(model, slots, layout, lambda: copy)
    assert not gathers.wait_at_install
    for region in (0, 1):
        gathers.add(copy, region, _Work(waited, region), torch.zeros(1))
    model[called_first](torch.zeros(1, 2))
    assert waited == [0, 1][:called_first + 1]  # the later region still in flight, or both
    model(torch.zeros(1, 2))
    assert waited == [0, 1]


def test_compiled_layers_wait_for_the_whole_version_when_it_is_installed():
    model, slots, layout = _two_layers()
    model[1]._compiled_call_impl = lambda *args: None  # what Module.compile sets
    gathers = param_gather.ParameterGathers(model, slots, layout, lambda: None)
    assert gathers.wait_at_install
    assert not any(m._forward_pre_hooks for m in model.modules())  # none traced into a graph
