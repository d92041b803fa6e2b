"""tests/collective_order.py: the recorder sees every collective once, under its own name (aliases
and collectives built of others included), and the check names the group, rank and position of
the first divergence, in a toy run on 4 gloo ranks that gloo completes but NCCL would not."""
import re

import pytest
import torch
import torch.distributed as dist

from megatron_2bw.distributed import comm
from tests.collective_order import (Call, CollectiveOrderError, check_same_order, load_calls,
                                    record_collectives, save_calls)
from tests.distributed_helpers import run_ranks

GATHER = comm.all_gather_into_tensor.__name__  # all_gather_single since torch 2.13


def toy_run(rank, world, log_dir, diverging_rank):
    """Collectives on the world and on pairs [0, 1] and [2, 3]; `diverging_rank` reduces its
    pair's sum with MAX instead (gloo exchanges the same bytes and returns; NCCL's ranks would
    run different kernels)."""
    with record_collectives() as calls:
        try:
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            pair = pairs[rank // 2]
            x = torch.ones(4)
            dist.all_reduce(x)
            gathered = torch.empty(8)
            comm.all_gather_into_tensor(gathered, x, group=pair)  # an alias bound at import
            op = dist.ReduceOp.MAX if rank == diverging_rank else dist.ReduceOp.SUM
            comm.all_reduce(x, pair, op=op)
            everyone = [None] * world
            dist.all_gather_object(everyone, rank)  # two all_gathers inside: recorded once
            dist.broadcast_object_list([rank, "x"], src=1)
            dist.barrier()
        finally:
            save_calls(calls, f"{log_dir}/{rank}.json")


def run_toy(tmp_path, diverging_rank):
    run_ranks(4, toy_run, str(tmp_path), diverging_rank, timeout=60)
    return {rank: load_calls(tmp_path / f"{rank}.json") for rank in range(4)}


def test_every_collective_is_recorded_once_under_its_group(tmp_path):
    logs = run_toy(tmp_path, diverging_rank=None)
    world, second = logs[2][0].group, logs[2][3].group
    assert [(call.group, call.what) for call in logs[2]] == [
        (world, "new_group(ranks=[0, 1])"),
        (world, "new_group(ranks=[2, 3])"),
        (world, "all_reduce(float32[4], op=SUM)"),
        (second, f"{GATHER}(float32[4])"),
        (second, "all_reduce(float32[4], op=SUM)"),
        (world, "all_gather_object()"),
        (world, "broadcast_object_list(object_list of 2, src=1)"),
        (world, "barrier()"),
    ]
    assert world.endswith("(world ranks [0, 1, 2, 3])") and second.endswith("[2, 3])")
    # the site is the caller's line, not torch's or the comm.py helper's
    assert all(call.site.startswith("test_collective_order.py:") for call in logs[2])
    counts = check_same_order(logs)
    assert sorted(counts.values()) == [2, 2, 6]


def test_a_divergent_run_fails_naming_group_rank_and_position(tmp_path):
    logs = run_toy(tmp_path, diverging_rank=3)
    with pytest.raises(CollectiveOrderError) as error:
        check_same_order(logs)
    message = str(error.value)
    assert re.fullmatch(
        r"group \S+ \(world ranks \[2, 3\]\): rank 3's collective #1 is all_reduce\(float32\[4\], "
        r"op=MAX\) at test_collective_order\.py:\d+, rank 2's is all_reduce\(float32\[4\], "
        r"op=SUM\) at test_collective_order\.py:\d+", message), message


def test_a_missing_or_extra_collective_is_named():
    group = "1 (world ranks [0, 1])"
    reduce = Call(group, "all_reduce(float32[4], op=SUM)", "a.py:1")
    barrier = Call(group, "barrier()", "a.py:2")
    missing = (r"rank 1's collective #1 is missing \(it issued 1\), "
               r"rank 0's is barrier\(\) at a\.py:2")
    with pytest.raises(CollectiveOrderError, match=missing):
        check_same_order({0: [reduce, barrier], 1: [reduce]})
    with pytest.raises(CollectiveOrderError, match=r"rank 1's collective #0 is missing \(it "
                                                   r"issued 0\), rank 0's is all_reduce"):
        check_same_order({0: [reduce], 1: []})
    with pytest.raises(CollectiveOrderError, match=r"rank 1's collective #0 is barrier"):
        check_same_order({0: [reduce, barrier], 1: [barrier, reduce]})
    assert check_same_order({0: [reduce, barrier], 1: [reduce, barrier]}) == {group: 2}
