"""V-shaped schedules at the action-list level: the placement, ZB-V, DualPipeV and V-Half lists checked
by the validator (data flow, versions, transfer order, replay), their memory against the papers'
tables, and the receive order NCCL needs on a V's rank pairs."""
import pytest

from megatron_2bw.pipeline import nccl_replay as R
from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.actions import flushed_batches, receives_in_send_order
from megatron_2bw.pipeline.placement import Placement
from megatron_2bw.pipeline.v_half import activation_budget
from megatron_2bw.planner.cost import INPUT_GRADIENT_SHARE, StageCost
from megatron_2bw.planner.memory import estimate_stage_memory
from megatron_2bw.planner.simulator import compiled_schedule, simulate
from tests.pipeline.harness import tiny_config
from megatron_2bw.pipeline.zb_v import zb_v_order

V_SCHEDULES = ("zb-v", "dualpipev", "v-half")


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
    """Every accepted m up to 4p; at p = 8 the smallest, 2p, 3p and 4p (regrouping each m's lists
    for NCCL takes seconds there, and the orders change shape only at those bounds)."""
    shapes = list(_accepted(schedule, stages))
    assert shapes, "some m must be accepted"
    if stages == 8:
        shapes = sorted({shapes[0], *(m for m in shapes if m % stages == 0 and m >= 2 * stages)})
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


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_v_half_holds_the_papers_memory(stages):
    """V-Half's table (arXiv 2405.15362): (p + 2) // 2 microbatches, i.e. 2 * ((p + 2) // 2)
    microbatch-chunks, on every rank and for every m."""
    for m in (1, stages, 2 * stages, 3 * stages + 1):
        peak = max(S.max_in_flight("v-half", stages, m, r, 2) for r in range(stages))
        assert peak <= activation_budget(stages) == 2 * ((stages + 2) // 2)
    assert peak == activation_budget(stages)  # the budget is used once m is large


def test_v_half_reaches_half_of_flush_memory_at_large_p():
    """Flush's first stage holds p microbatches (2p microbatch-chunks). V-Half's (p + 2) // 2 is
    at most 0.55x of it from p = 20 on; below that the + 2 weighs more (0.75x at p = 4)."""
    def ratio(p):
        m = 2 * p
        v_half = max(S.max_in_flight("v-half", p, m, r, 2) for r in range(p))
        return v_half / (2 * S.max_in_flight("flush", p, m, 0))
    assert ratio(4) == 0.75 and ratio(8) == 0.625
    assert ratio(20) <= 0.55


# per chunk: F = B (input gradient) = W = 1, a full backward 2; a 1F1B stage holds both chunks
CHUNK_TIMES = {S.FORWARD: 1.0, S.BACKWARD: 2.0, S.BACKWARD_INPUT: 1.0, S.BACKWARD_WEIGHT: 1.0}


def _idle_per_rank(schedule, p, m):
    chunks = S.REGISTRY[schedule].chunks or 1
    scale = 2 / chunks  # a one-chunk stage holds the V's two chunks of layers
    actions = S.build_schedule(schedule, p, m, 1, chunks=chunks)
    rows = S.timeline(actions, lambda s, a: scale * CHUNK_TIMES.get(a.kind, 0.0),
                      shape=S.REGISTRY[schedule].shape)
    makespan = max(t.end for row in rows for t in row)
    return makespan, [makespan - sum(t.end - t.start for t in row) for row in rows]


def test_replayed_bubbles_against_the_papers_formulas():
    """p = 4, m = 8, idle time per rank in units of one chunk's forward. The replay reproduces
    1F1B's (p-1)(F+B) and ZB-H1's (p-1)(F+B-W) (stage times) exactly. ZB-V's table says bubble
    rate 0 at equal F, B and W: its order leaves the start skew, (p-1) chunk forwards on every
    rank, and the lists the runtime posts (receives moved into earlier exchanges, which NCCL's
    blocking sends need) 2 units more. DualPipeV's README bound (p-1)(F&B+B-3W) (B the full backward, F&B = F+B with no
    overlap) is 2(p-1); the replay is below it. V-Half's table: bubble rate about p/(2m) of the
    longest rank's time; the replay is below it too."""
    p, m = 4, 8
    assert _idle_per_rank("flush", p, m)[1] == [(p - 1) * (2 + 4)] * p
    assert _idle_per_rank("zb-h1", p, m)[1] == [(p - 1) * (2 + 2 - 2)] * p
    assert _idle_per_rank("zb-v", p, m)[1] == [p - 1 + 2] * p
    assert max(_idle_per_rank("dualpipev", p, m)[1]) <= (p - 1) * ((1 + 2) + 2 - 3 * 1)
    makespan, idle = _idle_per_rank("v-half", p, m)
    assert max(idle) / makespan <= p / (2 * m)
    # the V's order: ZB-V below ZB-H1 below Flush, V-Half between ZB-V and Flush
    assert max(_idle_per_rank("zb-v", p, m)[1]) < max(idle) < (p - 1) * 6


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_the_planners_simulator_replays_a_v_as_the_schedule_replay(schedule):
    """Forward 1, backward 2 per stage (a chunk: half), no communication, p = 4, m = 8: the
    simulator's time per batch is the replay's makespan with the same per-chunk times, and its
    in-flight peaks are the registry's."""
    durations = [StageCost(1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0)] * 4
    result = simulate(compiled_schedule(schedule, 4, 8, 3, 2), durations, shape="v")
    chunk = {S.FORWARD: 0.5, S.BACKWARD: 1.0, S.BACKWARD_INPUT: INPUT_GRADIENT_SHARE,
             S.BACKWARD_WEIGHT: 1.0 - INPUT_GRADIENT_SHARE}
    rows = S.timeline(S.build_schedule(schedule, 4, 8, 1, chunks=2),
                      lambda s, a: chunk.get(a.kind, 0.0), shape="v")
    assert result.time_per_batch == pytest.approx(max(t.end for row in rows for t in row))
    assert result.peak_inflight_microbatches == [S.max_in_flight(schedule, 4, 8, s, 2)
                                                 for s in range(4)]


def test_the_memory_estimate_places_a_vs_layers_and_ends():
    """p = 4, 8 layers: a V's rank holds layers r and 7 - r; rank 0 both the embedding and the
    output layer, the last rank neither. Activations scale with the in-flight microbatch-chunks
    (half a 1F1B stage's each)."""
    def memory(schedule, stage):
        c = tiny_config(p=4, schedule=schedule, layers=8)
        return estimate_stage_memory(c.model, c.parallel, c.precision, c.recompute, "adam", 2, 8,
                                     1, stage)
    middle = memory("flush", 1)  # two layers, neither end
    for schedule in V_SCHEDULES:
        in_flight = S.max_in_flight(schedule, 4, 8, 1, 2) / 2
        assert memory(schedule, 1).activations == pytest.approx(
            middle.activations * in_flight / S.max_in_flight("flush", 4, 8, 1))
        assert memory(schedule, 3).params == middle.params  # no output layer on the last rank
        assert memory(schedule, 0).params > memory("flush", 0).params  # embedding and head


def test_a_vs_receives_move_into_earlier_exchanges_as_nccl_needs():
    """ZB-V at p = 2, m = 4 with each pass's transfers next to it: both ranks hold a send the other
    receives only in a later exchange, a deadlock under NCCL's rules; grouped_for_nccl moves
    receives (none added, none lost, computes untouched) until the replay runs through."""
    p, m = 2, 4
    raw = receives_in_send_order(
        [list(flushed_batches(zb_v_order(p, m, s), p, s, 2, m, 1, 0, "v")) for s in range(p)],
        "v")
    assert R.replay(raw, shape="v").deadlock is not None
    grouped = R.grouped_for_nccl(raw, "v")
    R.check(grouped, shape="v")
    S.validate(grouped, "zb-v", m)
    for before, after in zip(raw, grouped):
        assert sorted(map(str, before)) == sorted(map(str, after))
        computes = [a for a in before if a.kind not in S.COMM_KINDS]
        assert [a for a in after if a.kind not in S.COMM_KINDS] == computes
