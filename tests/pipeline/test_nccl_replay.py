"""The action lists replayed under NCCL's point-to-point rules (pipeline/nccl_replay.py): sends
that wait for their receive, each stage's exchanges in order, matching per pair in posting order
and form. Every generator is free of deadlock and mismatched transfers; lists that break a rule
are refused, named."""
import dataclasses

import pytest

from megatron_2bw.arguments import ConfigError, parse_config
from megatron_2bw.config_checks import validate_for_world
from megatron_2bw.pipeline import nccl_replay as R
from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.actions import flushed_batches
from megatron_2bw.pipeline.interleaved import interleaved_order


def _shapes(schedule: str):
    """(p, m, chunks) of every shape the generator accepts at p in {2, 3, 4, 8}, m up to 4p."""
    spec = S.REGISTRY[schedule]
    for p in (2, 3, 4, 8):
        for chunks in ((2, 3) if spec.chunks is None else (spec.chunks,)):
            for m in range(1, 4 * p + 1):
                try:
                    S.check_shape(schedule, p, m, 1, 0, chunks)
                except ValueError:
                    continue
                yield p, m, chunks


# The V placements (zb-v, dualpipev) are generated but not yet run by the executor; posted with
# the executor's grouping (the transfers between two computes in one batch) two ranks each hold
# a send the other receives only in a later exchange. They need their own grouping, as
# interleaved has Megatron-LM's, before the executor runs them.
V_DEADLOCK = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "deadlock under NCCL's rules with the executor's grouping of adjacent transfers"))


@pytest.mark.parametrize("schedule", [pytest.param(name, marks=V_DEADLOCK)
                                      if S.REGISTRY[name].shape == "v" else name
                                      for name in S.SCHEDULES])
def test_every_generator_is_deadlock_free_with_no_mismatched_transfer(schedule):
    shapes = list(_shapes(schedule))
    shape = S.REGISTRY[schedule].shape
    assert len(shapes) >= 8
    for p, m, chunks in shapes:
        lists = [S.build_schedule(schedule, p, m, 2, 0, chunks)]
        if shape == "loop":  # evaluation (the executor runs loop placements)
            lists.append([list(S.forward_only_actions(p, m, s, chunks)) for s in range(p)])
        for actions in lists:
            result = R.replay(actions, shape=shape)
            assert result.deadlock is None, (schedule, p, m, chunks, result.deadlock)
            assert result.mismatched == [] and result.other_form == [], (schedule, p, m, chunks)
            assert result.transfers == sum(a.kind in S.COMM_KINDS for row in actions for a in row)


def test_a_cycle_of_sends_passes_gloos_replay_and_deadlocks_under_nccls():
    # each stage first sends what the other receives only after a compute of its own
    actions = [[S.Action(S.SEND_ACT, 0), S.Action(S.FORWARD, 1, 0), S.Action(S.RECV_GRAD, 1)],
               [S.Action(S.SEND_GRAD, 1), S.Action(S.FORWARD, 2, 0), S.Action(S.RECV_ACT, 0)]]
    S.timeline(actions)  # gloo: sends never block
    with pytest.raises(S.ScheduleError) as error:
        R.check(actions)
    message = str(error.value)
    assert "deadlock under NCCL's rules" in message and "\n" not in message
    assert "stage 0 action 0 (send_act(0), batch_isend_irecv) waits for stage 1's recv_act(0), " \
           "behind its exchange at action 0 (send_grad(1))" in message
    assert "stage 1 action 0 (send_grad(1), batch_isend_irecv) waits for stage 0's " \
           "recv_grad(1), behind its exchange at action 0 (send_act(0))" in message


def test_receives_in_another_order_than_the_sends_are_mismatched_transfers():
    actions = [[S.Action(S.FORWARD, 0, 0), S.Action(S.SEND_ACT, 0), S.Action(S.FORWARD, 1, 0),
                S.Action(S.SEND_ACT, 1)],
               [S.Action(S.RECV_ACT, 1), S.Action(S.FORWARD, 1, 0), S.Action(S.RECV_ACT, 0),
                S.Action(S.FORWARD, 0, 0)]]
    assert len(R.replay(actions).mismatched) == 2
    with pytest.raises(S.ScheduleError, match=r"2 mismatched transfers .* first stage 0 action 1 "
                                              r"\(send_act\(0\), batch_isend_irecv\) met by stage "
                                              r"1 action 0 \(recv_act\(1\)"):
        R.check(actions)


def _single_when_alone(batch):
    return R.SINGLE if len(batch) == 1 else R.BATCHED


@pytest.mark.parametrize("schedule", ["gpipe", "flush", "zb-h1", "2bw"])
def test_a_lone_transfer_posted_single_meets_a_batched_one(schedule):
    actions = S.build_schedule(schedule, 4, 8, 1)
    assert R.replay(actions).other_form == []
    result = R.replay(actions, _single_when_alone)
    assert result.other_form and result.deadlock is not None
    with pytest.raises(S.ScheduleError, match="posted in another form than their match"):
        R.check(actions, _single_when_alone)


def _per_pass_interleaved(stages, microbatches, batches, stage, first_batch, chunks=1):
    """Interleaved with each pass's receive right before it and its send right after it."""
    order = interleaved_order(stages, microbatches, stage, chunks)
    yield from flushed_batches(order, stages, stage, chunks, microbatches, batches, first_batch)


def _interleaved_generator(monkeypatch, generator) -> None:
    spec = dataclasses.replace(S.REGISTRY["interleaved"], generator=generator)
    monkeypatch.setitem(S.REGISTRY, "interleaved", spec)


def test_interleaved_needs_megatrons_grouping_of_transfers(monkeypatch):
    _interleaved_generator(monkeypatch, _per_pass_interleaved)
    actions = S.build_schedule("interleaved", 2, 4, 1, 0, 2)
    S.validate(actions, "interleaved", 4)  # every rule as gloo runs it
    assert "stage 0 action 14 (send_grad(0/c1)" in R.replay(actions).deadlock


def test_a_list_that_would_deadlock_is_refused_before_training_in_one_line(monkeypatch):
    config, _ = parse_config(["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads",
                              "4", "--seq-length", "16", "--micro-batch-size", "1",
                              "--global-batch-size", "4", "--train-iters", "2", "--mock-data",
                              "--vocab-size", "64", "--pipeline-model-parallel-size", "2",
                              "--pipeline-schedule", "interleaved",
                              "--num-layers-per-virtual-pipeline-stage", "1"])
    assert validate_for_world(config, 2) == 1  # Megatron-LM's grouping: accepted
    _interleaved_generator(monkeypatch, _per_pass_interleaved)
    with pytest.raises(ConfigError) as error:
        validate_for_world(config, 2)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("--pipeline-schedule interleaved with p = 2, m = 4 breaks a "
                              "schedule rule: deadlock under NCCL's rules")
    assert "stage 0 action 14 (send_grad(0/c1), batch_isend_irecv) waits for stage 1's " \
           "recv_grad(0)" in message


def test_the_check_before_training_applies_every_schedule_rule(monkeypatch):
    """A rule of schedules.validate broken (a forward before its activation arrived)."""
    def no_receives(*args, **kwargs):
        return (a for a in _per_pass_interleaved(*args, **kwargs) if a.kind != S.RECV_ACT)
    _interleaved_generator(monkeypatch, no_receives)
    with pytest.raises(S.ScheduleError, match=r"^stage 0, action 4 \(F0/c1@v0\): forward "
                                              r"before its activation was received"):
        R.check_schedule("interleaved", 2, 4, 2)
