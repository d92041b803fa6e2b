"""When a stage's gradients are averaged over its data-parallel replicas (pipeline/update.py):
with --overlap-grad-reduce the all-reduce of the gradient buffer (with the distributed
optimizer its reduce-scatter) starts bucket by bucket during the batch's last backward, else at
reduce(b), and runs on, and the
stage waits for it before its next backward (under 2BW, after a forward has run) or at its step
(Flush: right away)."""
import dataclasses

import pytest

from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.executor import PipelineError
from megatron_2bw.pipeline import overlap as overlap_module, update
from megatron_2bw.training.segments import run_segment
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import gpt_feed, stage_on_rank, tiny_config

STARTED, IN = "average started", "average in"


def record_order(rank: int, world: int, schedule: str, distributed_optimizer: bool,
                 overlap: bool = False) -> list[str]:
    """Train 3 batches (p = 1, d = 2, m = 2); the order of the stage's actions (logged when each
    ends) and of the start and end of the gradient average."""
    config = tiny_config(p=1, schedule=schedule, optimizer="adam")
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, use_distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=overlap))
    layout, stage = stage_on_rank(rank, world, config)
    events: list[str] = []
    real_all_reduce, real_reduce_scatter = update.all_reduce, overlap_module.reduce_scatter_tensor

    class RecordedWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append(IN)
            return self.work.wait()

    def all_reduce(tensor, group, **options):
        work = real_all_reduce(tensor, group, **options)
        # the buffer of the moment: fp32 2BW trades it with the master gradients every batch
        gradients = stage.versions.main_grad_buffer.untyped_storage().data_ptr()
        if group is stage.updater.data_group and tensor.untyped_storage().data_ptr() == gradients:
            events.append(STARTED)
            return RecordedWork(work)
        return work

    def reduce_scatter(output, tensor, **options):
        events.append(STARTED)
        return RecordedWork(real_reduce_scatter(output, tensor, **options))

    update.all_reduce = overlap_module.all_reduce = all_reduce  # this forked rank's modules
    overlap_module.reduce_scatter_tensor = reduce_scatter
    run_action = stage.executor._run_one

    def logged(action, next_microbatch):
        run_action(action, next_microbatch)
        events.append(action.kind)

    stage.executor._run_one = logged
    run_segment(stage, 0, 3, gpt_feed(config, layout))
    return events


@pytest.fixture(scope="module")
def orders():
    return {(schedule, sharded, overlap): run_ranks(2, record_order, schedule, sharded, overlap)
            for schedule in ("2bw", "flush")
            for sharded, overlap in ((False, False), (True, False), (False, True), (True, True))}


def assert_started_and_waited(events: list[str], between: list[str], waiting: str,
                              in_backward: bool):
    """Each reduction starts (one start per bucket or region) inside the batch's last backward
    (`in_backward`: the bucket-by-bucket all-reduce) or inside reduce_grads (the distributed
    optimizer's reduce-scatter), and is waited for after `between` ran, inside `waiting`."""
    assert events.count(STARTED) == events.count(IN) >= 3, events
    first = events.index(STARTED)
    started_in = S.BACKWARD if in_backward else S.REDUCE_GRADS
    starts = events.index(started_in, first) - first
    assert events[first:first + starts] == [STARTED] * starts
    ended = [S.BACKWARD, S.REDUCE_GRADS] if in_backward else [S.REDUCE_GRADS]
    assert events[first + starts:first + 2 * starts + len(ended) + 1 + len(between)] == \
        [*ended, *between] + [IN] * starts + [waiting]


LAYOUTS = pytest.mark.parametrize("sharded, overlap", [(False, False), (True, False),
                                                      (False, True), (True, True)],
                                   ids=["after-backward", "distributed-optimizer", "overlap",
                                        "distributed-optimizer-overlap"])


@LAYOUTS
def test_2bw_averages_gradients_while_the_next_forward_runs(orders, sharded, overlap):
    for events in orders["2bw", sharded, overlap]:
        assert_started_and_waited(events, [S.FORWARD], S.BACKWARD, in_backward=overlap)


@LAYOUTS
def test_flush_waits_for_the_average_at_its_step(orders, sharded, overlap):
    for events in orders["flush", sharded, overlap]:
        assert_started_and_waited(events, [S.RELEASE_VERSION], S.STEP, in_backward=overlap)


def reduce_without_the_other_replica(rank: int, world: int) -> str | None:
    """Rank 1 never trains, so rank 0's background all-reduce of batch 0 cannot complete."""
    config = tiny_config(p=1, schedule="2bw", optimizer="adam")
    layout, stage = stage_on_rank(rank, world, config)
    if rank == 1:
        return None
    try:
        run_segment(stage, 0, 3, gpt_feed(config, layout))
    except PipelineError as error:
        return str(error)
    return "no error"


def test_a_reduction_that_never_completes_is_named_with_its_batch_and_the_waiting_action():
    message = run_ranks(2, reduce_without_the_other_replica, timeout=300)[0]
    assert message.startswith("stage 0 failed at B2@v0: the data-parallel gradient reduction of "
                              "batch 0, started with its last backward, failed"), message
