"""When a stage's gradients are averaged over its data-parallel replicas (pipeline/update.py):
reduce(b) leaves the all-reduce of the gradient buffer running, and the stage waits for it before
its next backward (under 2BW, after a forward has run) or at its step (Flush: right away)."""
import pytest

from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline import update
from megatron_2bw.training import run_segment
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import gpt_feed, stage_on_rank, tiny_config

STARTED, IN = "average started", "average in"


def record_order(rank: int, world: int, schedule: str) -> list[str]:
    """Train 3 batches (p = 1, d = 2, m = 2); the order of the stage's actions (logged when each
    ends) and of the start and end of the gradient average."""
    config = tiny_config(p=1, schedule=schedule, optimizer="adam")
    layout, stage = stage_on_rank(rank, world, config)
    events: list[str] = []
    gradients = stage.versions.main_grad_buffer.untyped_storage().data_ptr()
    real_all_reduce = update.all_reduce

    class RecordedWork:
        def __init__(self, work):
            self.work = work

        def wait(self, timeout=None):
            events.append(IN)
            return self.work.wait(timeout)

    def all_reduce(tensor, group, op=None, async_op=False):
        work = real_all_reduce(tensor, group, op=op, async_op=async_op)
        if group is stage.updater.data_group and \
                tensor.untyped_storage().data_ptr() == gradients:
            events.append(STARTED)
            return RecordedWork(work)
        return work

    update.all_reduce = all_reduce  # this forked rank's module only
    run_action = stage.executor._run_one

    def logged(action, next_microbatch):
        run_action(action, next_microbatch)
        events.append(action.kind)

    stage.executor._run_one = logged
    run_segment(stage, 0, 3, gpt_feed(config, layout))
    return events


@pytest.fixture(scope="module")
def orders():
    return {schedule: run_ranks(2, record_order, schedule) for schedule in ("2bw", "flush")}


def test_2bw_averages_gradients_while_the_next_forward_runs(orders):
    for events in orders["2bw"]:
        assert events.count(STARTED) == 3, events
        first = events.index(STARTED)
        assert events[first:first + 5] == [STARTED, S.REDUCE_GRADS, S.FORWARD, IN, S.BACKWARD]


def test_flush_waits_for_the_average_at_its_step(orders):
    for events in orders["flush"]:
        assert events.count(STARTED) == 3, events
        first = events.index(STARTED)
        assert events[first:first + 5] == [STARTED, S.REDUCE_GRADS, S.RELEASE_VERSION, IN, S.STEP]
