"""The training loop's progress log: time per iteration from the ends of the batches."""
import re

import pytest

from megatron_2bw import training
from megatron_2bw.config import Config
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.logging import Timers
from megatron_2bw.pipeline.update import StepResult


def test_time_per_iteration_counts_batches_not_deferred_steps_or_evaluation(monkeypatch, capsys):
    """Two segments of 3 batches of 1 s under 2BW: the steps run late, the last two back to back at
    the drain, and 10 s of evaluation separate the segments. Every logged iteration took 1 s; the
    first of a segment also carries the fill (0.2 s) and the previous segment's drain (0.2 s), so
    the intervals add up to the segments' time."""
    config = Config()
    config.training.log_interval, config.training.train_iters = 1, 6
    config.training.global_batch_size = 4
    clock = {"now": 0.0}
    monkeypatch.setattr(training.time, "perf_counter", lambda: clock["now"])
    log = training.ProgressLog(config, ParallelLayout(1, 1, 1), Timers(log_level=0), 0)

    def segment(start: float, first_batch: int) -> None:
        clock["now"] = start
        log.begin_segment()
        ends = [start + 1.2, start + 2.2, start + 3.2]  # the ends of the batches' last backward
        steps = [start + 2.5, start + 3.3, start + 3.35]  # deferred; the drain runs the last two
        for k, (ended, stepped) in enumerate(zip(ends, steps)):
            clock["now"] = stepped
            log(StepResult(first_batch + k, False, 1.0, 1e-3, 1.0, {"lm loss": 5.0}, ended))
        clock["now"] = start + 3.4
        log.end_segment()

    segment(0.0, 0)
    segment(13.4, 3)  # after 10 s of evaluation
    logged = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                           capsys.readouterr().out)]
    assert logged == pytest.approx([1200, 1000, 1000, 1400, 1000, 1000], abs=0.5)
    # --auto-parallel's measured figure leaves out the first interval (the start)
    assert log.interval_throughputs == pytest.approx([4.0, 4.0, 4 / 1.4, 4.0, 4.0])
