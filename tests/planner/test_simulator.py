import dataclasses
import math
import random

import pytest

from megatron_2bw.pipeline.schedules import build_schedule
from megatron_2bw.planner.cost import CoreSharing, StageCost, time_per_batch_lower_bound
from megatron_2bw.planner.simulator import compiled_schedule, simulate


def stage(forward=1.0, backward=2.0, send_act=0.0, send_grad=0.0, reduce=0.0, background=0.0,
          step=0.0) -> StageCost:
    return StageCost(forward, backward, send_act, send_grad, reduce, background, step)


def run(schedule, stages, microbatches, durations, batches=3):
    return simulate(compiled_schedule(schedule, stages, microbatches, batches), durations)


@pytest.mark.parametrize("schedule, expected", [
    ("2bw", 8 * 3.0),  # never drained: m (F + B)
    ("flush", 8 * 3.0 + 3 * 3.0),  # + (p - 1)(F + B) to fill and drain
    ("gpipe", 8 * 3.0 + 3 * 3.0),
])
def test_time_per_batch_and_bubble(schedule, expected):
    result = run(schedule, 4, 8, [stage()] * 4)
    assert result.time_per_batch == pytest.approx(expected)
    assert result.bubble_fraction == pytest.approx(1 - 24.0 / expected)
    assert result.breakdown["compute"] == pytest.approx(24.0)
    assert result.bottleneck.startswith("compute stage")


def test_in_flight_microbatches():
    assert run("2bw", 4, 8, [stage()] * 4).peak_inflight_microbatches == [4, 3, 2, 1]
    assert run("flush", 4, 8, [stage()] * 4).peak_inflight_microbatches == [4, 3, 2, 1]
    gpipe = simulate(compiled_schedule("gpipe", 4, 8, 3), [stage()] * 4, [10.0] * 4)
    assert gpipe.peak_inflight_microbatches == [8] * 4
    assert gpipe.peak_activation_bytes == [80.0] * 4


def test_transfers_delay_the_one_forward_one_backward_cycle():
    # two stages alternate: per microbatch both computations plus the activation and the gradient
    # transfer, half each: F + B + (c_act + c_grad) / 2
    durations = [stage(send_act=1.0), stage(send_grad=1.0)]
    result = run("2bw", 2, 8, durations)
    assert result.time_per_batch == pytest.approx(8 * (3.0 + 1.0))
    assert result.breakdown["p2p"] > 0
    slow_link = run("2bw", 2, 8, [stage(send_act=30.0), stage(send_grad=30.0)])
    assert slow_link.bottleneck == "p2p"


def test_reduce_blocks_and_the_step_waits_for_background_collectives():
    per_batch = [stage(reduce=5.0, step=1.0)] * 2
    assert run("2bw", 2, 4, per_batch).time_per_batch == pytest.approx(4 * 3.0 + 6.0)
    assert run("flush", 2, 4, per_batch).time_per_batch == pytest.approx(4 * 3.0 + 3.0 + 6.0)
    assert run("flush", 2, 4, [stage(reduce=50.0, step=1.0)] * 2).bottleneck == \
        "data-parallel all-reduce"
    # the background all-reduce (30) is hidden by 2BW's deferred step only as far as a batch goes
    background = [stage(background=30.0)] * 2
    hidden = run("2bw", 2, 8, background).time_per_batch
    flushed = run("flush", 2, 8, background).time_per_batch
    assert 24.0 < hidden < flushed and flushed == pytest.approx(24.0 + 3.0 + 30.0)


def test_an_average_left_running_must_be_in_before_the_next_backward_or_step():
    # p = 1, m = 2, F 1 s, B 2 s, a 5 s data-parallel average left running by each reduce:
    # 2BW (reduce F B F B step) overlaps it with one forward and waits 4 s before the backward;
    # Flush (reduce step) waits all 5 s at its step
    averaging = [StageCost(1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, reduce_background_s=5.0)]
    two_bw = run("2bw", 1, 2, averaging)
    assert two_bw.time_per_batch == pytest.approx(2 * 3.0 + 4.0)
    assert two_bw.breakdown["data_parallel"] == pytest.approx(4.0)
    assert run("flush", 1, 2, averaging).time_per_batch == pytest.approx(2 * 3.0 + 5.0)
    short = [StageCost(1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, reduce_background_s=0.5)]
    assert run("2bw", 1, 2, short).time_per_batch == pytest.approx(2 * 3.0)


def test_bubble_bottleneck_with_few_microbatches():
    assert run("gpipe", 8, 2, [stage()] * 8).bottleneck == "pipeline bubble"


def test_slowest_stage_sets_the_pace():
    durations = [stage(), stage(forward=2.0, backward=4.0), stage()]
    result = run("2bw", 3, 6, durations)
    assert result.time_per_batch == pytest.approx(6 * 6.0)
    assert result.busiest_stage == 1 and result.bottleneck == "compute stage 1"


def test_action_lists_and_compiled_lists_agree():
    durations = [stage(send_act=0.3), stage(send_act=0.2, send_grad=0.1), stage(send_grad=0.4)]
    plain = simulate(build_schedule("flush", 3, 5, 3), durations)
    assert plain == run("flush", 3, 5, durations)


def test_needs_three_batches_and_one_duration_per_stage():
    with pytest.raises(ValueError, match="3 batches"):
        run("2bw", 2, 2, [stage()] * 2, batches=2)
    with pytest.raises(ValueError, match="durations"):
        run("2bw", 2, 2, [stage()])


def random_case(rng: random.Random) -> tuple[str, int, int, list[StageCost]]:
    """A schedule, p, m and stage durations with transfers, reduces, background collectives and
    averages, steps and blocking-collective parts of every kind."""
    p = rng.choice([1, 2, 3, 4, 8])
    m = rng.choice([p, p + 1, 2 * p, 3 * p + 5])
    schedule = rng.choice(["2bw", "flush", "gpipe"])
    durations = []
    for s in range(p):
        forward, backward = rng.uniform(0.5, 2), rng.uniform(1, 4)
        reduce, step = rng.choice([0, 0.1, 1]) * rng.uniform(0, 30), \
            rng.choice([0, 0.1, 1]) * rng.uniform(0, 20)
        durations.append(StageCost(
            forward, backward, rng.choice([0, 0.2, 3]) * rng.random() * (s < p - 1),
            rng.choice([0, 0.2, 3]) * rng.random() * (s > 0), reduce,
            rng.choice([0, 0.1, 1]) * rng.uniform(0, 40), step,
            tied_async_s=rng.choice([0, 0.5]) * (s == 0 < p - 1),
            forward_comm_s=rng.random() * forward / 2, backward_comm_s=rng.random() * backward / 2,
            step_comm_s=rng.random() * step, reduce_background_s=rng.choice([0, 0, 0.5, 5]) * rng.random()))
    return schedule, p, m, durations


def test_lower_bound_never_exceeds_the_replay():
    rng = random.Random(0)
    for _ in range(300):
        schedule, p, m, durations = random_case(rng)
        replay = run(schedule, p, m, durations).time_per_batch
        assert time_per_batch_lower_bound(durations, schedule, m) <= replay * (1 + 1e-9)


def test_with_a_processor_per_rank_both_replays_agree():
    """The shared-clock replay (ranks sharing processors) reduces to the per-stage clocks when a
    node has a processor for every rank: same times, waits, in-flight peaks."""
    rng = random.Random(1)
    for _ in range(100):
        schedule, p, m, durations = random_case(rng)
        actions = compiled_schedule(schedule, p, m, 3)
        enough = CoreSharing(ranks=((1,) * p,), slots=p)
        alone, shared = simulate(actions, durations), simulate(actions, durations, sharing=enough)
        assert shared.time_per_batch == pytest.approx(alone.time_per_batch, rel=1e-9)
        assert shared.peak_inflight_microbatches == alone.peak_inflight_microbatches
        assert shared.breakdown.pop("shared_cores") == pytest.approx(0.0, abs=1e-9)
        for cause, seconds in alone.breakdown.items():
            assert shared.breakdown[cause] == pytest.approx(seconds, rel=1e-9, abs=1e-9)


def test_ranks_sharing_a_processor_take_turns_except_while_blocked():
    # two replicas of one stage on one processor: each computes at half speed, but both wait in
    # the 4 s data-parallel all-reduce at full time
    two_on_one = CoreSharing(ranks=((2,),), slots=1)
    durations = [StageCost(2.0, 2.0, 0.0, 0.0, 1.0, 0.0, 1.0, reduce_background_s=4.0)]
    result = simulate(compiled_schedule("flush", 1, 2, 3), durations, sharing=two_on_one)
    # per microbatch (2 + 2) x 2 s; per batch 2 x 8 + reduce (1 x 2 + 4) + step 1 x 2
    assert result.time_per_batch == pytest.approx(2 * 8.0 + 6.0 + 2.0)
    assert result.breakdown["shared_cores"] == pytest.approx(2 * 4.0 + 1.0 + 1.0)
    assert two_on_one.bound(durations, 2) == pytest.approx(2 * (2 * 4.0 + 1.0 + 1.0) / 1)


def test_taking_turns_costs_the_measured_overhead():
    # the same two replicas whose compute needs 25% more processor time while they take turns;
    # with a processor each they do not take turns and pay nothing
    durations = [dataclasses.replace(stage(2.0, 2.0), turn_overhead=0.25)]
    flush = compiled_schedule("flush", 1, 2, 3)
    turns = simulate(flush, durations, sharing=CoreSharing(ranks=((2,),), slots=1))
    assert turns.time_per_batch == pytest.approx(2 * (2 + 2) * 2 * 1.25)
    own = simulate(flush, durations, sharing=CoreSharing(ranks=((2,),), slots=2))
    assert own.time_per_batch == pytest.approx(2 * (2 + 2))


def test_on_a_crowded_node_a_rank_computing_alone_still_pays_the_overhead():
    # three Flush stages on two processors: in the fill and the drain fewer stages compute than
    # there are processors, yet their caches went cold in the others' turns, so every piece of
    # compute is 1.25 times as long and so is the batch; the node's bound counts the overhead too
    schedule = compiled_schedule("flush", 3, 3, 3)
    two = CoreSharing(ranks=((1, 1, 1),), slots=2)
    plain = [stage(), stage(forward=2.0, backward=3.0), stage()]
    slowed = [dataclasses.replace(cost, turn_overhead=0.25) for cost in plain]
    plain_time = simulate(schedule, plain, sharing=two).time_per_batch
    assert plain_time > two.bound(plain, 3) * 1.1  # the bubbles, not the bound, set the pace
    slowed_time = simulate(schedule, slowed, sharing=two).time_per_batch
    assert slowed_time == pytest.approx(1.25 * plain_time)
    assert two.bound(slowed, 3) == pytest.approx(1.25 * 3 * (3.0 + 5.0 + 3.0) / 2)


def test_a_pipeline_on_fewer_processors_than_stages():
    # 2BW, two equal stages on one processor: they alternate, never both idle; the node's
    # processor runs both stages' work, 2 x m x (F + B) per batch
    one = CoreSharing(ranks=((1, 1),), slots=1)
    result = simulate(compiled_schedule("2bw", 2, 4, 3), [stage()] * 2, sharing=one)
    assert result.time_per_batch == pytest.approx(2 * 4 * 3.0)
    # an uneven pair: the light stage idles while waiting for the heavy one, which then has the
    # processor to itself; never faster than the bound, never slower than running them in turn
    uneven = [stage(), stage(forward=3.0, backward=6.0)]
    result = simulate(compiled_schedule("2bw", 2, 4, 3), uneven, sharing=one)
    assert one.bound(uneven, 4) <= result.time_per_batch <= 4 * (3.0 + 9.0) + 1e-9
    for schedule in ("2bw", "flush", "gpipe"):
        rng = random.Random(2)
        for _ in range(30):
            _, p, m, durations = random_case(rng)
            if schedule in ("2bw", "flush") and m < p:
                continue
            sharing = CoreSharing(ranks=((1,) * p,), slots=max(1, p // 2))
            shared = simulate(compiled_schedule(schedule, p, m, 3), durations, sharing=sharing)
            alone = simulate(compiled_schedule(schedule, p, m, 3), durations)
            assert shared.time_per_batch >= alone.time_per_batch * (1 - 1e-9)
            assert shared.time_per_batch >= sharing.bound(durations, m) * (1 - 1e-9)


def tensor_parallel_stage(wake: float, forward=3.0, backward=2.0, comm=1.0, calls=2) -> StageCost:
    """A stage whose forward holds `calls` tensor-parallel all-reduces taking `comm` seconds in
    all, `wake` of each of them waiting for a peer's turn."""
    return dataclasses.replace(stage(forward, backward), forward_comm_s=comm,
                               forward_collectives=calls, wake_s=wake)


def test_a_peers_turn_is_waited_for_only_while_other_ranks_have_work():
    flush = compiled_schedule("flush", 1, 2, 3)
    # one tensor-parallel pair with the node to itself: nobody takes a peer's turn, so each
    # forward skips its two 0.25 s waits: 2 x (3 - 0.5 + 2) per batch
    alone = CoreSharing(ranks=((2,),), slots=2, tensor_parallel=2)
    assert simulate(flush, [tensor_parallel_stage(0.25)], sharing=alone).time_per_batch == \
        pytest.approx(2 * 4.5)
    # two pairs on two processors (data-parallel replicas): the other pair always has work, so
    # every wait is paid (2 x 0.5 s per forward); the pairs drift out of step, the other one
    # computing for a share `duty` of the time: the fixed point of duty = (4 / rate) /
    # (4 / rate + 1) with rate = 2 / (2 + 2 duty) (4 s of compute and 1 s of collectives per
    # microbatch), 4 duty^2 + duty - 4 = 0
    replicas = CoreSharing(ranks=((4,),), slots=2, tensor_parallel=2)
    duty = (math.sqrt(65) - 1) / 8
    assert simulate(flush, [tensor_parallel_stage(0.25)], sharing=replicas).time_per_batch == \
        pytest.approx(2 * (4 * (1 + duty) + 2 * 0.5))


def test_a_pair_waiting_for_its_lagging_peer_holds_a_processor():
    """Two tensor-parallel pairs, one per stage, on two processors. While stage 1's pair waits
    in an all-reduce its processors go to stage 0; during a wait for a peer's turn the lagging
    peer computes, so stage 0 gets one processor, not two: the same waits counted as plain
    collective time would let the pipeline run faster."""
    sharing = CoreSharing(ranks=((2, 2),), slots=2, tensor_parallel=2)
    schedule = compiled_schedule("2bw", 2, 4, 4)
    light = stage(2.0, 2.0)
    peer_turns = simulate(schedule, [light, tensor_parallel_stage(1.0, comm=2.0)],
                          sharing=sharing)
    plain = simulate(schedule, [light, tensor_parallel_stage(0.0, comm=2.0)], sharing=sharing)
    assert peer_turns.time_per_batch > plain.time_per_batch * 1.02
    assert peer_turns.breakdown["shared_cores"] > plain.breakdown["shared_cores"]
    # one processor: a held wait takes all of it, and the other stage waits for the processor
    one = CoreSharing(ranks=((2, 2),), slots=1, tensor_parallel=2)
    durations = [light, tensor_parallel_stage(1.0, comm=2.0)]
    assert simulate(schedule, durations, sharing=one).time_per_batch >= \
        one.bound(durations, 4) * (1 - 1e-9)


def test_a_pass_alternates_compute_and_its_collectives():
    """Two pairs on two processors, one per stage, each forward 2 s of compute and 2 s in
    all-reduces. With all its compute first and then all its collectives, a stage's compute
    falls largely into the other stage's collectives; alternated in pieces, as the runtime runs
    a layer, the stages' compute overlaps more and runs at half speed longer."""
    sharing = CoreSharing(ranks=((2, 2),), slots=2, tensor_parallel=2)
    schedule = compiled_schedule("2bw", 2, 4, 4)

    def pair(calls):
        return tensor_parallel_stage(0.0, forward=4.0, backward=1.0, comm=2.0, calls=calls)
    whole = simulate(schedule, [pair(1), pair(1)], sharing=sharing)
    pieces = simulate(schedule, [pair(4), pair(4)], sharing=sharing)
    assert pieces.time_per_batch > whole.time_per_batch * 1.02
    assert pieces.breakdown["shared_cores"] > whole.breakdown["shared_cores"]
