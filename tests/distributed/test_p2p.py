"""Pipeline transfers: receives posted ahead under gloo, so a send leaves while its receiver
computes."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_2bw.distributed.forked import run_forked
from megatron_2bw.distributed.p2p import PipelineP2P

SHAPE = (2, 8, 4)
SENDER_WAIT_S = 60  # how long the receiver waits, before its first receive, for the first send


def _pair(rank: int, post_ahead: bool) -> PipelineP2P:
    return PipelineP2P(None if rank == 0 else 0, 1 if rank == 0 else None, dist.group.WORLD,
                       SHAPE, torch.float32, torch.device("cpu"), post_ahead)


def _sent_before_the_receive(rank: int, world: int, post_ahead: bool, sent_flag: str,
                             wait_s: float):
    """Rank 0 sends three activations and marks `sent_flag` once its first send completed; rank
    1, told to expect them, receives only after seeing the mark (or after `wait_s`). Rank 1
    returns whether the first send completed before it received, and what it received."""
    p2p = _pair(rank, post_ahead)
    if rank == 1:
        p2p.expect({"act": 3})
    dist.barrier()
    if rank == 0:
        p2p.exchange([("act", torch.full(SHAPE, 1.0))], [])
        p2p.wait_sends()
        open(sent_flag, "w").close()
        for value in (2.0, 3.0):
            p2p.exchange([("act", torch.full(SHAPE, value))], [])
        p2p.wait_sends()
        return None
    deadline = time.monotonic() + wait_s
    while not os.path.exists(sent_flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    sent_first = os.path.exists(sent_flag)
    received = [p2p.exchange([], ["act"])[0] for _ in range(2)]
    with pytest.raises(RuntimeError, match="still pending"):  # a segment leaves none behind
        p2p.expect({"act": 1})
    received.append(p2p.exchange([], ["act"])[0])
    return sent_first, [t.unique().tolist() for t in received]


@pytest.mark.parametrize("post_ahead", [True, False])
def test_a_receive_posted_ahead_lets_the_send_leave_while_the_receiver_computes(post_ahead,
                                                                                  tmp_path):
    # without receives ahead the send cannot complete before the receive whatever the wait, so a
    # short wait suffices there; with them it completes, the wait only bounds a broken runtime
    wait_s = SENDER_WAIT_S if post_ahead else 1.0
    _, (sent_first, received) = run_forked(2, _sent_before_the_receive, post_ahead,
                                           str(tmp_path / "sent"), wait_s, timeout=180)
    assert received == [[1.0], [2.0], [3.0]]  # in order, whichever way they were posted
    # gloo's rendezvous: without a receive posted ahead the data waits for it (why receives go
    # ahead)
    assert sent_first == post_ahead


def test_receives_are_posted_ahead_under_gloo_only():
    def backend_choice(rank, world):
        return _pair(rank, None).post_ahead
    assert run_forked(2, backend_choice, timeout=300) == [True, True]


def _one_f_one_b_exchanges(rank: int, world: int, post_ahead: bool):
    """Stage 0 sends activation k and receives gradient k-1 in one exchange; stage 1 the
    reverse, as in 1F1B's steady state."""
    p2p = _pair(rank, post_ahead)
    p2p.expect({"grad": 3} if rank == 0 else {"act": 3})
    got = []
    if rank == 0:
        p2p.exchange([("act", torch.full(SHAPE, 0.0))], [])
        for k in range(1, 3):
            got += p2p.exchange([("act", torch.full(SHAPE, float(k)))], ["grad"])
        got += p2p.exchange([], ["grad"])
    else:
        for k in range(3):
            [act] = p2p.exchange([("grad", torch.full(SHAPE, 9.0 + k))] if k else [], ["act"])
            got.append(act)
        p2p.exchange([("grad", torch.full(SHAPE, 12.0))], [])
    p2p.wait_sends()
    return [t.unique().tolist() for t in got]


@pytest.mark.parametrize("post_ahead", [True, False])
def test_sends_and_receives_in_one_exchange_pair_up_in_order(post_ahead):
    grads, acts = run_forked(2, _one_f_one_b_exchanges, post_ahead, timeout=300)
    assert acts == [[0.0], [1.0], [2.0]] and grads == [[10.0], [11.0], [12.0]]


def _long_segment(rank: int, world: int, post_ahead: bool, sends: int):
    """Rank 0 sends `sends` activations, one per exchange; it returns the most sends it held
    pending at once, rank 1 the values it received."""
    p2p = _pair(rank, post_ahead)
    if rank == 1:
        p2p.expect({"act": sends})
        return [p2p.exchange([], ["act"])[0].unique().item() for _ in range(sends)]
    most = 0
    for k in range(sends):
        p2p.exchange([("act", torch.full(SHAPE, float(k)))], [])
        most = max(most, p2p.pending_sends())
    p2p.wait_sends()
    assert p2p.pending_sends() == 0
    return most


@pytest.mark.parametrize("post_ahead", [True, False])
def test_a_long_segment_holds_the_tensors_of_two_sends_at_most(post_ahead):
    """gloo reports a send complete only once waited for: without waiting for older sends, a
    segment between two evaluations would keep every activation it ever sent."""
    most, received = run_forked(2, _long_segment, post_ahead, 30, timeout=300)
    assert received == [float(k) for k in range(30)]
    assert most <= 2


class _OneWorkForAll:
    """What NCCL's batch_isend_irecv returns: the batch coalesced into a single work, which may
    be waited for again (gloo's may not: a second wait blocks)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        while self.works:
            self.works.pop().wait()
        return True


def _coalesced_one_f_one_b_exchanges(rank: int, world: int):
    batched = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [_OneWorkForAll(batched(ops))]  # this forked rank only
    return _one_f_one_b_exchanges(rank, world, False)


def test_a_batch_coalesced_into_one_work_as_under_nccl_pairs_up_in_order():
    grads, acts = run_forked(2, _coalesced_one_f_one_b_exchanges, timeout=300)
    assert acts == [[0.0], [1.0], [2.0]] and grads == [[10.0], [11.0], [12.0]]
