"""--overlap-grad-reduce: the data-parallel all-reduce started bucket by bucket during the last
backward gives exactly the weights of starting it after the backward (itself checked against a
single process in test_pipeline_equivalence), with buckets smaller than a parameter and a
parameter spanning several, in fp32 and with bf16's fp32 gradient buffer."""
import dataclasses

import pytest
import torch

from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, max_difference, tiny_config, train_on_ranks
from megatron_2bw.config import PrecisionConfig


def _train(rank: int, world: int, overlap: bool, bf16: bool):
    config = tiny_config(p=2, optimizer="adam", lr=1e-3, global_batch=8, layers=2)
    config = dataclasses.replace(
        config, precision=PrecisionConfig(bf16=bf16),
        parallel=dataclasses.replace(config.parallel, ddp_bucket_size=1000,
                                     overlap_grad_reduce=overlap))
    started = []
    result = train_on_ranks(rank, world, config, 3,
                            before=lambda stage: started.append(stage.updater.backward_reducer))
    return {**result, "overlapping": started[0] is not None}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_overlapped_average_equals_the_average_after_the_backward(bf16):
    after = run_ranks(4, _train, False, bf16)  # p = 2 x d = 2
    overlapped = run_ranks(4, _train, True, bf16)
    assert all(r["overlapping"] for r in overlapped) and not any(r["overlapping"] for r in after)
    assert max_difference(full_weights(overlapped), full_weights(after), 101) == 0.0
    assert [r["results"] for r in overlapped] == [r["results"] for r in after]
