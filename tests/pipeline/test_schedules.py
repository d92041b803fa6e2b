"""Schedules as data: every generated list passes the validator; broken lists are rejected with the
stage, position and rule."""
import collections
import dataclasses
import re

import pytest

from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.actions import transfer_kind


SHAPES = [(1, 1, 3, 0), (2, 2, 4, 0), (4, 4, 3, 0), (4, 6, 3, 5), (3, 5, 2, 1), (8, 8, 3, 0)]


@pytest.mark.parametrize("schedule,stages,microbatches,batches,first",
                         [(s, *shape) for s in S.SCHEDULES for shape in SHAPES
                          if (s != "interleaved" or shape[1] % shape[0] == 0)  # m a multiple of p
                          and shape[1] >= S.REGISTRY[s].min_microbatches(shape[0])]
                         + [("gpipe", 4, 2, 3, 0)])  # GPipe alone allows m < p
def test_generated_schedules_are_valid(schedule, stages, microbatches, batches, first):
    spec = S.REGISTRY[schedule]
    chunks = spec.chunks or 1
    actions = S.build_schedule(schedule, stages, microbatches, batches, first, chunks)
    S.validate(actions, schedule, microbatches, first)
    for stage, stage_list in enumerate(actions):  # what the transfers post ahead, per wire kind
        received = collections.Counter(transfer_kind(a, spec.shape) for a in stage_list
                                       if a.kind in (S.RECV_ACT, S.RECV_GRAD))
        expected = S.stage_receives(stages, microbatches, batches, stage, chunks, spec.shape)
        assert {kind: n for kind, n in expected.items() if n} == dict(received)


def test_2bw_warmup_is_once_and_steady_state_alternates():
    p, m = 4, 4
    actions = S.build_schedule("2bw", p, m, 3)
    for stage, stage_actions in enumerate(actions):
        compute = [a.kind[0] for a in stage_actions if a.kind in S.COMPUTE_KINDS]
        warmup = p - stage - 1
        assert compute[:warmup] == ["f"] * warmup
        steady = compute[warmup:len(compute) - warmup]
        assert steady == ["f", "b"] * (len(steady) // 2)  # never drained between batches
    # flush drains every batch: stage 0 runs p-1 warm-up forwards in every batch
    flush_stage0 = [a.kind[0] for a in S.build_schedule("flush", p, m, 3)[0] if a.kind in S.COMPUTE_KINDS]
    assert flush_stage0[:3] == ["f"] * 3 and flush_stage0[8:11] == ["f"] * 3


def test_2bw_versions_and_deferred_step():
    actions = S.build_schedule("2bw", 2, 2, 4)
    stage0 = actions[0]
    versions = {a.microbatch: a.version for a in stage0 if a.kind == S.FORWARD}
    assert versions == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 2, 7: 2}
    # step(b) comes after reduce(b), before the first forward of batch b+2
    position = {str(a): i for i, a in enumerate(stage0)}
    for b in range(3):
        step = next(i for i, a in enumerate(stage0) if a.kind == S.STEP and a.batch == b)
        reduce = next(i for i, a in enumerate(stage0) if a.kind == S.REDUCE_GRADS and a.batch == b)
        assert reduce < step
        if b + 2 < 4:
            assert step < position[f"F{2 * (b + 2)}@v{b + 1}"]


@pytest.mark.parametrize("stages,microbatches,batches,first", [s for s in SHAPES if s[2] > 1])
def test_2bw_steps_keep_their_steady_state_slot_in_the_drain(stages, microbatches, batches, first):
    # step(b) on stage r comes where the first forward of batch b+2 comes in the steady state, after
    # the stage's backward of microbatch (b+2)m - (p-r-1) - 1; in the final drain that forward is
    # missing, and the step must not slide to the end of batch b+1: the first stage starts its part
    # of the global grad norm in its step, and the later stages' steps wait for it
    m = microbatches
    for stage, stage_list in enumerate(S.build_schedule("2bw", stages, m, batches, first)):
        warmup = stages - stage - 1
        backwards = 0
        for a in stage_list:
            backwards += a.kind == S.BACKWARD
            if a.kind == S.STEP and a.batch < first + batches - 1:  # the last one ends the segment
                assert backwards == (a.batch + 2 - first) * m - warmup, (stage, str(a))


def test_in_flight_limits():
    for schedule, limit in (("2bw", lambda s: 4 - s), ("flush", lambda s: 4 - s), ("gpipe", lambda s: 6)):
        for s, stage_actions in enumerate(S.build_schedule(schedule, 4, 6, 2)):
            live = peak = 0
            for a in stage_actions:
                live += (a.kind == S.FORWARD) - (a.kind == S.BACKWARD)
                peak = max(peak, live)
            assert peak == limit(s)


def _replace(actions, stage, index, **changes):
    broken = [list(x) for x in actions]
    broken[stage][index] = dataclasses.replace(broken[stage][index], **changes)
    return broken


def test_validator_rejects_a_wrong_version():
    actions = S.build_schedule("2bw", 2, 2, 3)
    index = next(i for i, a in enumerate(actions[1]) if a.kind == S.FORWARD and a.microbatch == 4)
    with pytest.raises(S.ScheduleError, match=r"stage 1, action \d+ \(F4@v0\).*version 1"):
        S.validate(_replace(actions, 1, index, version=0), "2bw", 2)


def test_validator_rejects_a_deadlock():
    actions = S.build_schedule("flush", 2, 2, 1)
    # stage 0 waits for the gradient of microbatch 1 before sending activation 1: a cycle
    stage0 = actions[0]
    send1 = next(i for i, a in enumerate(stage0) if a.kind == S.SEND_ACT and a.microbatch == 1)
    recv1 = next(i for i, a in enumerate(stage0) if a.kind == S.RECV_GRAD and a.microbatch == 1)
    backward1 = next(i for i, a in enumerate(stage0) if a.kind == S.BACKWARD and a.microbatch == 1)
    reordered = [a for i, a in enumerate(stage0) if i != send1]
    reordered.insert(reordered.index(stage0[backward1]) + 1, stage0[send1])
    assert recv1 < backward1
    with pytest.raises(S.ScheduleError, match="deadlock: stage 0 at action"):
        S.validate([reordered, actions[1]], "flush", 2)


def test_validator_rejects_three_live_versions_and_unmatched_sends():
    actions = S.build_schedule("2bw", 2, 2, 3)
    no_release = [[a for a in stage if a.kind != S.RELEASE_VERSION] for stage in actions]
    with pytest.raises(S.ScheduleError, match="holds 3 weight versions"):
        S.validate(no_release, "2bw", 2)
    extra = [list(actions[0]) + [S.Action(S.SEND_ACT, 0)], actions[1]]
    with pytest.raises(S.ScheduleError):
        S.validate(extra, "2bw", 2)


def test_validator_rejects_too_many_in_flight():
    actions = S.build_schedule("gpipe", 2, 4, 1)
    with pytest.raises(S.ScheduleError, match="microbatches in flight"):
        S.validate(actions, "flush", 4)


def test_m_below_p_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="microbatches per batch >= stages"):
        list(S.stage_actions("2bw", 4, 2, 1, 0))


def test_render_shows_every_stage_and_versions():
    text = S.render(S.build_schedule("2bw", 4, 4, 3))
    lines = text.splitlines()
    assert [line.split("|")[0].strip() for line in lines[:4]] == [f"stage {s}" for s in range(4)]
    assert "F8v1" in text and "B11v1" in text


def test_render_keeps_two_digit_labels_apart():
    text = S.render(S.build_schedule("2bw", 2, 4, 3))
    labels = re.findall(r"[FB]\d+v\d+", text.splitlines()[0])
    assert "F10v1" in labels and "B9v1" in labels  # not run together as F10v1B9v1
    assert not re.search(r"v\d+[FB]", text)


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-vs"])
@pytest.mark.parametrize("stages,microbatches", [(2, 1), (4, 1), (4, 2), (3, 5), (1, 1)])
def test_pipedream_versions_follow_the_per_stage_rule(schedule, stages, microbatches):
    """Batch b on stage s reads max(0, b - (p-1-s)) (vertical sync: max(0, b - (p-1))), forward
    and backward alike; with enough batches each stage holds exactly its bound of versions."""
    m, batches = microbatches, 3 * stages + 2
    actions = S.build_schedule(schedule, stages, m, batches)
    S.validate(actions, schedule, m)
    for s, stage_list in enumerate(actions):
        delay = stages - 1 if schedule == "pipedream-vs" else stages - 1 - s
        for a in stage_list:
            if a.kind in S.COMPUTE_KINDS:
                assert a.version == max(0, a.microbatch // m - delay), (s, str(a))
        alive, peak = {0}, 1
        for a in stage_list:
            alive |= {a.version} if a.kind == S.STEP else set()
            alive -= {a.version} if a.kind == S.RELEASE_VERSION else set()
            peak = max(peak, len(alive))
        assert peak == S.live_versions(schedule, stages, s) == delay + 1


def test_pipedream_steps_after_every_microbatch_without_a_drain():
    actions = S.build_schedule("pipedream", 4, 1, 8)
    for stage, stage_list in enumerate(actions):
        compute = [a.kind[0] for a in stage_list if a.kind in S.COMPUTE_KINDS]
        warmup = 4 - stage - 1
        steady = compute[warmup:len(compute) - warmup]
        assert compute[:warmup] == ["f"] * warmup and steady == ["f", "b"] * (len(steady) // 2)
        assert [a.batch for a in stage_list if a.kind == S.STEP] == list(range(8))




def test_validator_rejects_a_backward_on_another_version_than_its_forward():
    actions = S.build_schedule("pipedream", 2, 1, 4)
    index = next(i for i, a in enumerate(actions[0])
                 if a.kind == S.BACKWARD and a.microbatch == 2)
    broken = _replace(actions, 0, index, version=2)  # the forward read version 1
    with pytest.raises(S.ScheduleError, match=r"stage 0, action \d+ \(B2@v2\): pipedream must use "
                                              r"version 1"):
        S.validate(broken, "pipedream", 1)
    # a schedule whose rule it is still breaks weight stashing: forward on 1, backward on 2
    forward = next(i for i, a in enumerate(actions[0]) if a.kind == S.FORWARD and a.microbatch == 2)
    broken = _replace(_replace(actions, 0, forward, version=2), 0, index, version=1)
    with pytest.raises(S.ScheduleError, match=rf"stage 0, action {forward} \(F2@v2\)"):
        S.validate(broken, "pipedream", 1)


def test_validator_rejects_too_many_live_pipedream_versions():
    actions = S.build_schedule("pipedream", 4, 1, 8)
    no_release = [[a for a in stage if a.kind != S.RELEASE_VERSION] for stage in actions]
    with pytest.raises(S.ScheduleError, match=r"stage 0, action \d+ \(step\(b3->v4\)\): pipedream "
                                              r"holds 5 weight versions on stage 0 \(at most 4\)"):
        S.validate(no_release, "pipedream", 1)


def _moved_after(stage_list, moved, anchor):
    """`stage_list` with the first action matching `moved` put right after the first matching
    `anchor`, and the anchor's position."""
    result = list(stage_list)
    action = result.pop(next(i for i, a in enumerate(result) if moved(a)))
    position = next(i for i, a in enumerate(result) if anchor(a))
    result.insert(position + 1, action)
    return result, position


def _is(kind, **fields):
    return lambda a: a.kind == kind and all(getattr(a, k) == v for k, v in fields.items())


@pytest.mark.parametrize("schedule,p,m,stage,moved,anchor,rule", [
    # the reduce of batch 0 moved after batch 1's first backward on stage 1
    ("2bw", 2, 2, 1, _is(S.REDUCE_GRADS, batch=0), _is(S.BACKWARD, microbatch=2),
     r"\(B2@v0\): gradient buffer: backward of batch 1 writes the buffer before batch 0's "
     r"gradients were reduced"),
    # with m = 4 PipeDream's first stage needs version 1 only at batch 4, so its step of batch 0
    # could slide: moved after the reduce of batch 1, it would lose batch 0's gradients
    ("pipedream", 4, 4, 0, _is(S.STEP, batch=0), _is(S.REDUCE_GRADS, batch=1),
     r"\(reduce_grads\(b1\)\): gradient buffer: batch 1's reduction reuses the master "
     r"gradients before batch 0's step"),
], ids=["reduce-after-next-backward", "step-after-next-reduce"])
def test_validator_rejects_gradient_buffer_misuse(schedule, p, m, stage, moved, anchor, rule):
    actions = S.build_schedule(schedule, p, m, 6)
    actions[stage], position = _moved_after(actions[stage], moved, anchor)
    with pytest.raises(S.ScheduleError, match=rf"stage {stage}, action {position} {rule}"):
        S.validate(actions, schedule, m)


def test_validator_rejects_a_batch_never_stepped():
    actions = S.build_schedule("2bw", 2, 2, 3)
    dropped = [[a for a in stage if not (a.kind == S.STEP and a.batch == 2)] for stage in actions]
    with pytest.raises(S.ScheduleError, match="stage 0: batch 2 is never stepped"):
        S.validate(dropped, "2bw", 2)


@pytest.mark.parametrize("schedule,stages,microbatches,batches,first",
                         [(s, *shape) for s in S.SCHEDULES for shape in SHAPES
                          if (s != "interleaved" or shape[1] % shape[0] == 0)
                          and shape[1] >= S.REGISTRY[s].min_microbatches(shape[0])])
def test_a_backward_runs_between_reduce_and_step_exactly_where_a_stage_holds_two_versions(
        schedule, stages, microbatches, batches, first):
    """WeightVersions lets the master gradients be the accumulation buffer on a stage with one
    weight version: no backward may write the buffer between a batch's reduction and its step.
    With more versions (2BW, PipeDream) one does, on every stage, for every batch followed by
    another: why those stages keep the master gradients apart (docs/precision_memory.md), and
    sharded, in a working copy, which is free throughout that window."""
    chunks = S.REGISTRY[schedule].chunks or stages
    for stage in range(stages):
        capacity = S.live_versions(schedule, stages, stage)
        several = capacity > 1
        between, reduced = {}, set()
        alive = set(range(S.version_for_batch(schedule, first, stage, stages), first + 1))
        actions = S.stage_actions(schedule, stages, microbatches, batches, stage, first, chunks)
        for a in actions:
            if a.kind == S.REDUCE_GRADS:
                reduced.add(a.batch)
                between[a.batch] = 0
            elif a.kind == S.STEP:
                reduced.discard(a.batch)
                alive.add(a.version)
            elif a.kind == S.RELEASE_VERSION:
                alive.discard(a.version)
            elif a.kind in (S.BACKWARD, S.BACKWARD_WEIGHT):
                for b in reduced:
                    between[b] += 1
            assert not (several and reduced) or len(alive) < capacity, (stage, a, alive)
        followed = [b for b in between if b + 1 in between]
        assert all(between[b] == 0 for b in between) if not several else \
            all(between[b] > 0 for b in followed), (stage, between)
