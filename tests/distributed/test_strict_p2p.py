"""Strict transfers (strict_p2p.py): gloo keeping NCCL's point-to-point rules. Each rule has a
case that gloo alone lets pass and strict mode refuses, named."""
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_2bw.distributed import strict_p2p
from megatron_2bw.distributed.forked import run_forked
from megatron_2bw.distributed.p2p import PipelineP2P


@pytest.fixture(params=[True, False], ids=["strict", "plain-gloo"])
def strict(request, monkeypatch):
    monkeypatch.setenv(strict_p2p.ENV, "1" if request.param else "0")  # the forked ranks read it
    return request.param


def _passes_on_gloo_fails_strict(strict: bool, fn, gloo_result, strict_error: str,
                                 rank: int = 1):
    """Plain gloo: `fn` gives `gloo_result` on `rank` (what would hang or swap data on GPUs);
    strict mode: the run fails with `strict_error` (a regular expression)."""
    if not strict:
        assert run_forked(2, fn, timeout=60)[rank] == gloo_result
        return
    with pytest.raises(RuntimeError, match=strict_error):
        run_forked(2, fn, timeout=60)


def _installed(rank: int, world: int):
    return strict_p2p.installed()


def test_the_test_suite_runs_its_ranks_in_strict_mode():
    assert run_forked(2, _installed, timeout=60) == [True, True]


def _single_against_batched(rank: int, world: int):
    if rank == 0:
        dist.isend(torch.full((4,), 7.0), 1).wait()
        return None
    buffer = torch.zeros(4)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, 0)]):
        work.wait()
    return buffer.tolist()


def test_a_send_posted_single_and_received_batched(strict):
    # gloo matches the two forms: what would hang on GPUs passes
    _passes_on_gloo_fails_strict(strict, _single_against_batched, [7.0] * 4,
                                 r"rank 0's send\(tag 0\) posted as a single "
                                 r"isend/irecv was matched by rank 1's recv\(tag 0\) "
                                 r"posted as batch_isend_irecv: .*different "
                                 r"communicators")


def _receives_in_the_opposite_order(rank: int, world: int):
    if rank == 0:
        ops = [dist.P2POp(dist.isend, torch.full((4,), float(tag)), 1, tag=tag) for tag in (0, 1)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return None
    buffers = {tag: torch.zeros(4) for tag in (1, 0)}
    ops = [dist.P2POp(dist.irecv, buffer, 0, tag=tag) for tag, buffer in buffers.items()]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {tag: buffer[0].item() for tag, buffer in buffers.items()}


def test_two_receives_posted_in_the_opposite_order_to_their_sends(strict):
    # gloo pairs them by tag; NCCL ignores tags and would swap the data
    _passes_on_gloo_fails_strict(strict, _receives_in_the_opposite_order, {0: 0.0, 1: 1.0},
                                 r"rank 0's send\(tag 0\) posted as batch_isend_irecv "
                                 r"was matched by rank 1's recv\(tag 1\) "
                                 r".*posting order")


def _pipeline_microbatches_swapped(rank: int, world: int):
    """Two activations of one kind: the receiver expects microbatch 1 first."""
    p2p = PipelineP2P(None if rank == 0 else 0, 1 if rank == 0 else None, dist.group.WORLD,
                      (2, 3), torch.float32, torch.device("cpu"))
    if rank == 0:
        for k in (0, 1):
            p2p.exchange([("act", torch.full((2, 3), float(k)))], [], [(k, 0)])
        p2p.wait_sends()
        return None
    return [p2p.exchange([], ["act"], [(k, 0)])[0][0, 0].item() for k in (1, 0)]


def test_the_receiver_checks_the_microbatch_it_expected(strict):
    # same kind, same tag: plain gloo hands microbatch 0 to the receive of 1
    _passes_on_gloo_fails_strict(strict, _pipeline_microbatches_swapped, [0.0, 1.0],
                                 r"rank 0's send\(tag 0, microbatch 0, chunk 0\) .*"
                                 r"matched by rank 1's recv\(tag 0, microbatch 1, "
                                 r"chunk 0\)")


def _blocking_sends_in_a_cycle(rank: int, world: int):
    """Both ranks send first, then receive: fine where sends are buffered (gloo), a deadlock
    where a send waits for its receive and the rank's transfers run in order (NCCL)."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    peer = 1 - rank
    buffer = torch.zeros(4)
    send = dist.isend(torch.full((4,), float(rank)), peer, group=group)
    dist.irecv(buffer, peer, group=group).wait()
    send.wait()
    return buffer[0].item()


def test_a_cycle_of_blocking_sends_deadlocks_and_the_timeout_names_it(strict):
    # gloo buffers the sends; rank 0 receives rank 1's value. Strict: the first rank to time out
    # names it (the other may then see its peer gone instead)
    _passes_on_gloo_fails_strict(strict, _blocking_sends_in_a_cycle, 1.0,
                                 r"rank (0|1)'s send\(tag 0\) posted as a single isend/irecv to "
                                 r"rank (1|0) did not complete: rank (1|0) never posted its "
                                 r"receive within the group's timeout", rank=0)

def test_a_launched_rank_turns_strict_mode_on_from_the_environment():
    """What torchrun's ranks in the functional tests run: init_distributed installs it."""
    script = ("from megatron_2bw.distributed import launch, strict_p2p\n"
              "launch.init_distributed('gloo', 1)\n"
              "print('strict', strict_p2p.installed())\n")
    for value, expected in (("1", "strict True"), ("0", "strict False")):
        env = dict(os.environ, **{strict_p2p.ENV: value})
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                text=True, timeout=120)
        assert expected in result.stdout, result.stderr
