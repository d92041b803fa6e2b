"""--overlap-grad-reduce: the data-parallel average started bucket by bucket during the last
backward (all-reduce, or the distributed optimizer's reduce-scatter) gives exactly the weights,
norms and losses of starting it after the backward (itself checked against a single process in
test_pipeline_equivalence and tests/optim/test_distributed.py), at p = 2 x d = 2 for every
schedule (zb-h1's split backward accumulates the weight gradients in its W passes; interleaved
chunks have m x chunks backwards per batch), with buckets smaller than a parameter and a
parameter spanning several, in fp32 and with bf16's fp32 gradient buffer."""
import dataclasses

import pytest

from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, max_difference, tiny_config
from tests.pipeline.precision_harness import train_stage
from megatron_2bw.config import PrecisionConfig
from megatron_2bw.pipeline.flat_layout import FlatLayout


def _train(rank: int, world: int, schedule: str, sharded: bool, overlap: bool, bf16: bool):
    chunks = 2 if schedule == "interleaved" else 1
    config = tiny_config(p=2, schedule=schedule, optimizer="adam", lr=1e-3, global_batch=8,
                         layers=2 * chunks,
                         untie_embeddings_and_output_weights=schedule == "pipedream")
    config = dataclasses.replace(
        config, precision=PrecisionConfig(bf16=bf16),
        parallel=dataclasses.replace(config.parallel, ddp_bucket_size=1000,
                                     virtual_pipeline_parallel=chunks if chunks > 1 else None,
                                     use_distributed_optimizer=sharded,
                                     overlap_grad_reduce=overlap))
    started_early = []  # per batch: buckets whose reduction started before reduce()

    def watch(stage):
        reducer = stage.updater.backward_reducer
        if reducer is None:
            return
        finish = reducer.finish

        def counted_finish():
            started_early.append(sum(reducer._started))
            return finish()
        reducer.finish = counted_finish

    result = train_stage(rank, world, config, 3, before=watch)
    return {**result, "started_early": started_early}


CASES = [("2bw", False, False), ("2bw", True, False), ("2bw", False, True), ("2bw", True, True),
         ("flush", True, False), ("gpipe", False, False), ("pipedream", True, False),
         ("zb-h1", False, False), ("zb-h1", True, False), ("interleaved", False, False),
         ("interleaved", True, False)]


@pytest.mark.parametrize("schedule, sharded, bf16", CASES,
                         ids=[f"{s}-{'zero1' if z else 'dp'}-{'bf16' if b else 'fp32'}"
                              for s, z, b in CASES])
def test_overlapped_average_equals_the_average_after_the_backward(schedule, sharded, bf16):
    after = run_ranks(4, _train, schedule, sharded, False, bf16)  # p = 2 x d = 2
    overlapped = run_ranks(4, _train, schedule, sharded, True, bf16)
    assert not any(r["started_early"] for r in after)
    # every batch on every rank started some bucket before the backward ended
    assert all(len(r["started_early"]) == 3 and min(r["started_early"]) > 0 for r in overlapped)
    assert max_difference(full_weights(overlapped), full_weights(after), 101) == 0.0
    assert [r["results"] for r in overlapped] == [r["results"] for r in after]


def test_sharded_layout_cuts_buckets_after_a_parameter():
    numels, tied = [5, 12, 7, 3, 9], [False, True, False, False, False]
    layout = FlatLayout.build(numels, tied, alignment=4, bucket_elements=8)
    # tied first; then [5, 7] (12 >= 8), then [3, 9], each padded to a multiple of 4
    assert layout.regions == ((0, 12), (12, 24), (24, 36))
    assert layout.offsets == (12, 0, 17, 24, 27)
    assert FlatLayout.build(numels, tied, alignment=4).regions == ((0, 12), (12, 36))
    for d in (2, 4):  # every parameter's part on a rank is one piece, the parts tile it
        for i, n in enumerate(numels):
            parts = sorted((s.owned_part(i).lo, s.owned_part(i).hi) for s in
                           (dataclasses.replace(layout, shards=d, rank=r) for r in range(d)))
            assert [x for lo, hi in parts for x in range(lo, hi)] == list(range(n))
