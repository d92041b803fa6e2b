"""V-shaped schedules at the action-list level: the placement, ZB-V and DualPipeV lists checked
by the validator (data flow, versions, transfer order, replay), their memory against the papers'
tables, and the receive order NCCL needs on a V's rank pairs."""
import pytest

from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.actions import flushed_batches, receives_in_send_order
from megatron_2bw.pipeline.placement import Placement
from megatron_2bw.pipeline.zb_v import zb_v_order

V_SCHEDULES = ("zb-v", "dualpipev")


@pytest.mark.parametrize("shape,chunks", [("loop", 1), ("loop", 3), ("v", 2)])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_every_virtual_stage_has_one_position(shape, chunks, stages):
    placement = Placement(stages, chunks, shape)
    seen = {placement.position(v) for v in range(placement.virtual_stages)}
    assert seen == {(r, c) for r in range(stages) for c in range(chunks)}
    for r in range(stages):
        for c in range(chunks):
            assert placement.position(placement.virtual_stage(r, c)) == (r, c)


def test_a_v_turns_on_the_last_rank_and_ends_on_the_first():
    v = Placement(4, 2, "v")
    assert v.is_first(0, 0) and v.is_last(0, 1)  # embedding and output layer on rank 0
    assert v.next(3, 0) == (3, 1) and v.is_local(3, v.next(3, 0))
    assert v.next(1, 1) == (0, 1) and not v.is_local(1, v.next(1, 1))
    assert v.previous(2, 1) == (3, 1)
    with pytest.raises(ValueError, match="2 model chunks"):
        Placement(4, 3, "v")


def _accepted(schedule, p):
    for m in range(1, 4 * p + 1):
        try:
            S.check_shape(schedule, p, m, 1, 0, 2)
        except ValueError:
            continue
        yield m


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
def test_v_schedules_are_valid_for_every_accepted_shape(schedule, stages):
    shapes = list(_accepted(schedule, stages))
    assert shapes, "some m must be accepted"
    for m in shapes:
        actions = S.build_schedule(schedule, stages, m, 2, first_batch=1, chunks=2)
        S.validate(actions, schedule, m, first_batch=1)
        # no transfer at the V's turn: the last rank neither sends nor receives chunk 0's output
        last = actions[stages - 1]
        if stages > 1:
            assert not any(a.kind == S.SEND_ACT and a.chunk == 0 for a in last)
            assert not any(a.kind == S.RECV_GRAD and a.chunk == 0 for a in last)


def test_dualpipev_needs_two_microbatches_per_rank():
    with pytest.raises(ValueError, match="dualpipev needs microbatches per batch >= 2 x stages"):
        S.build_schedule("dualpipev", 4, 7, 1, chunks=2)
    with pytest.raises(ValueError, match="zb-v runs 2 model chunks per stage"):
        S.build_schedule("zb-v", 4, 8, 1, chunks=1)


def test_a_v_rank_pair_would_receive_out_of_send_order_without_alignment():
    p, m = 2, 4
    raw = [list(flushed_batches(zb_v_order(p, m, s), p, s, 2, m, 1, 0, "v")) for s in range(p)]
    with pytest.raises(S.ScheduleError, match="another order"):
        S.validate(raw, "zb-v", m)
    aligned = receives_in_send_order(raw, "v")
    S.validate(aligned, "zb-v", m)
    assert sum(map(len, aligned)) == sum(map(len, raw))  # moved, none added or lost


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_v_peak_activations_match_the_papers(stages):
    """In microbatch-chunks, each half a 1F1B stage's activations: ZB-V holds 1F1B's peak (2p
    halves = p microbatches), DualPipeV PP + 1 with PP = 2p stages (its README's table)."""
    m = 3 * stages
    zb_v = max(S.max_in_flight("zb-v", stages, m, r, 2) for r in range(stages))
    dualpipe_v = max(S.max_in_flight("dualpipev", stages, m, r, 2) for r in range(stages))
    assert zb_v == 2 * S.max_in_flight("flush", stages, m, 0)
    assert dualpipe_v == 2 * stages + 1
