"""Pipeline transfers: one batch per exchange, in the order of the schedule."""
import torch
import torch.distributed as dist

from megatron_2bw.distributed.forked import run_forked
from megatron_2bw.distributed.p2p import PipelineP2P

SHAPE = (2, 8, 4)


def _pair(rank: int) -> PipelineP2P:
    return PipelineP2P(None if rank == 0 else 0, 1 if rank == 0 else None, dist.group.WORLD,
                       SHAPE, torch.float32, torch.device("cpu"))


def _forms_posted(rank: int, world: int):
    """Rank 0 sends one activation alone, then one with a receive; rank 1 the reverse. Returns
    the sizes of the batches posted: every exchange, even of one transfer, is one batch."""
    batches = []
    batched = dist.batch_isend_irecv

    def recording(ops):
        batches.append(len(ops))
        return batched(ops)
    dist.batch_isend_irecv = recording  # this forked rank only
    p2p = _pair(rank)
    if rank == 0:
        p2p.exchange([("act", torch.full(SHAPE, 1.0))], [], [(0, 0)])
        [grad] = p2p.exchange([("act", torch.full(SHAPE, 2.0))], ["grad"], [(1, 0), (0, 0)])
        got = grad.unique().tolist()
    else:
        [act] = p2p.exchange([], ["act"], [(0, 0)])
        [act2] = p2p.exchange([("grad", torch.full(SHAPE, 5.0))], ["act"], [(0, 0), (1, 0)])
        got = act.unique().tolist() + act2.unique().tolist()
    p2p.wait_sends()
    return batches, got


def test_every_exchange_is_one_batch_even_of_one_transfer():
    (batches0, grad), (batches1, acts) = run_forked(2, _forms_posted, timeout=120)
    assert batches0 == [1, 2] and batches1 == [1, 2]
    assert grad == [5.0] and acts == [1.0, 2.0]


def _one_f_one_b_exchanges(rank: int, world: int):
    """Stage 0 sends activation k and receives gradient k-1 in one exchange; stage 1 the
    reverse, as in 1F1B's steady state (labelled, so strict mode checks every message)."""
    p2p = _pair(rank)
    got = []
    if rank == 0:
        p2p.exchange([("act", torch.full(SHAPE, 0.0))], [], [(0, 0)])
        for k in range(1, 3):
            got += p2p.exchange([("act", torch.full(SHAPE, float(k)))], ["grad"],
                                [(k, 0), (k - 1, 0)])
        got += p2p.exchange([], ["grad"], [(2, 0)])
    else:
        for k in range(3):
            [act] = p2p.exchange([("grad", torch.full(SHAPE, 9.0 + k))] if k else [], ["act"],
                                 [(k - 1, 0), (k, 0)] if k else [(k, 0)])
            got.append(act)
        p2p.exchange([("grad", torch.full(SHAPE, 12.0))], [], [(2, 0)])
    p2p.wait_sends()
    return [t.unique().tolist() for t in got]


def test_sends_and_receives_in_one_exchange_pair_up_in_order():
    grads, acts = run_forked(2, _one_f_one_b_exchanges, timeout=300)
    assert acts == [[0.0], [1.0], [2.0]] and grads == [[10.0], [11.0], [12.0]]


def _long_segment(rank: int, world: int, sends: int):
    """Rank 0 sends `sends` activations, one per exchange; it returns the most sends it held
    pending at once, rank 1 the values it received."""
    p2p = _pair(rank)
    if rank == 1:
        return [p2p.exchange([], ["act"])[0].unique().item() for _ in range(sends)]
    most = 0
    for k in range(sends):
        p2p.exchange([("act", torch.full(SHAPE, float(k)))], [])
        most = max(most, p2p.pending_sends())
    p2p.wait_sends()
    assert p2p.pending_sends() == 0
    return most


def test_a_long_segment_holds_the_tensors_of_two_sends_at_most():
    """gloo reports a send complete only once waited for: without waiting for older sends, a
    segment between two evaluations would keep every activation it ever sent."""
    most, received = run_forked(2, _long_segment, 30, timeout=300)
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
    return _one_f_one_b_exchanges(rank, world)


def test_a_batch_coalesced_into_one_work_as_under_nccl_pairs_up_in_order():
    grads, acts = run_forked(2, _coalesced_one_f_one_b_exchanges, timeout=300)
    assert acts == [[0.0], [1.0], [2.0]] and grads == [[10.0], [11.0], [12.0]]
