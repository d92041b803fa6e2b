"""The progress log: time per iteration from the ends of the batches, what reaches the sinks
(--tensorboard-log-interval, --log-timers-to-tensorboard, --log-validation-ppl-to-tensorboard) and
the timers across a pipeline's ranks (--timing-log-level)."""
import json
import math
import re

import pytest

from megatron_2bw.config import Config, LoggingConfig
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.logging import Timers
from megatron_2bw.pipeline.update import StepResult
from megatron_2bw.training import progress
from tests.data.helpers import load_tool
from tests.distributed_helpers import run_ranks
from tests.training.runs import TINY, pretrain_on_rank


@pytest.mark.parametrize("log_interval,expected_ms,throughputs", [
    (1, [1200, 1000, 1000, 1400, 1000, 1000], [4.0, 4.0, 4 / 1.4, 4.0, 4.0]),
    (2, [1100, 1200, 1000], [4 / 1.2, 4.0]),  # the interval of iterations 3-4 spans the drain
])
def test_time_per_iteration_counts_batches_not_deferred_steps_or_evaluation(
        log_interval, expected_ms, throughputs, monkeypatch, capsys):
    """Two segments of 3 batches of 1 s under 2BW: the steps run late, the last two back to back at
    the drain, and 10 s of evaluation separate the segments. Every iteration took 1 s; the first of
    a segment also carries the fill (0.2 s) and the previous segment's drain (0.2 s), so the
    intervals add up to the segments' time."""
    config = Config()
    config.training.log_interval, config.training.train_iters = log_interval, 6
    config.training.global_batch_size = 4
    clock = {"now": 0.0}
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock["now"])
    log = progress.ProgressLog(config, ParallelLayout(1, 1, 1), Timers(log_level=0), 0)

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
    assert logged == pytest.approx(expected_ms, abs=0.5)
    # --auto-parallel's measured figure leaves out the first interval (the start)
    assert log.interval_throughputs == pytest.approx(throughputs)


def _log_six_iterations(tmp_path, monkeypatch, timers: Timers, **logging_fields) -> list[dict]:
    """ProgressLog over iterations 1-6 (--log-interval 3; iteration i's loss is i, iteration 4's
    step skipped) writing a --log-file; its records."""
    config = Config(logging=LoggingConfig(log_file=str(tmp_path / "log.jsonl"), **logging_fields))
    config.training.log_interval, config.training.train_iters = 3, 6
    config.training.global_batch_size = 4
    monkeypatch.setattr(progress.time, "perf_counter", lambda: 0.0)
    log = progress.ProgressLog(config, ParallelLayout(1, 1, 1), timers, 0)
    log.begin_segment()
    for batch in range(6):
        log(StepResult(batch, batch == 3, 1.5, 1e-3, 1.0, {"lm loss": batch + 1.0}, batch + 1.0))
    log.sink.close()
    return [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]


INTERVAL_FIGURES = {"skipped-iterations", "tokens-per-sec", "tflops", "time-per-iter-ms",
                    "consumed-samples", "global-batch-size"}


def test_sinks_get_every_nth_iterations_values_and_the_interval_figures(tmp_path, monkeypatch,
                                                                      capsys):
    records = _log_six_iterations(tmp_path, monkeypatch, Timers(log_level=0),
                                  tensorboard_log_interval=2)
    own = {"lm loss", "learning-rate", "loss-scale", "grad-norm"}
    assert [(r["iteration"], set(r) - {"iteration"}) for r in records] == [
        (2, own), (3, INTERVAL_FIGURES), (4, own - {"grad-norm"}),  # iteration 4 was skipped
        (6, own | INTERVAL_FIGURES)]  # one record when both fall on an iteration
    assert [r.get("lm loss") for r in records] == [2.0, None, 4.0, 6.0]  # not the interval means
    printed = re.findall(r"lm loss: ([0-9.E+-]+)", capsys.readouterr().out)
    assert [float(x) for x in printed] == [2.0, 5.0]  # the printed line keeps the interval means


@pytest.mark.parametrize("with_timers", [False, True])
def test_timers_reach_the_sinks_only_with_the_flag(with_timers, tmp_path, monkeypatch, capsys):
    timers = Timers(log_level=1)
    for name in ("forward", "backward", "optimizer"):
        timers(name).start()
        timers(name).stop()
    records = _log_six_iterations(tmp_path, monkeypatch, timers,
                                  log_timers_to_tensorboard=with_timers)
    timer_keys = {key for r in records for key in r if key.startswith("timers/")}
    assert timer_keys == ({"timers/forward-ms", "timers/backward-ms", "timers/optimizer-ms"}
                          if with_timers else set())
    assert "bubble-fraction" in records[2]
    assert "bubble: " in capsys.readouterr().out  # the printed line is the same either way


def test_a_2bw_pipeline_prints_every_intervals_timers_across_its_ranks(capfd):
    """The stages end an interval at different points of 2BW's schedule, which never drains:
    the exchange must neither hang nor lose an interval."""
    run_ranks(2, pretrain_on_rank, [*TINY, "--pipeline-model-parallel-size", "2",
                                    "--global-batch-size", "8", "--log-interval", "2",
                                    "--timing-log-level", "1", "--eval-interval", "6"],
              timeout=120)
    out = capfd.readouterr().out
    blocks = re.findall(r"time across ranks \(ms per iteration, iterations (\d+)-(\d+)\):\n"
                        r"((?:    .*\n)+)", out)
    assert [(int(a), int(b)) for a, b, _ in blocks] == [(1, 2), (3, 4), (5, 6)]
    for _, _, lines in blocks:
        figures = {line.split(" .")[0].strip(): line.split(": (")[1].rstrip(")").split(", ")
                   for line in lines.splitlines()}
        assert set(figures) == {"forward", "backward", "p2p-wait", "allreduce", "optimizer"}
        low, high = map(float, figures["forward"])
        assert 0 < low <= high  # both stages ran forwards
        low, high = map(float, figures["p2p-wait"])
        assert 0 < low <= high  # and both waited for the other


@pytest.mark.parametrize("with_ppl", [False, True])
def test_a_runs_log_file_plots_and_holds_validation_ppl_with_the_flag(with_ppl, tmp_path):
    log_file = tmp_path / "log.jsonl"
    run_ranks(1, pretrain_on_rank, [*TINY, "--log-interval", "3", "--tensorboard-log-interval", "2",
                             "--log-file", str(log_file),
                             *(["--log-validation-ppl-to-tensorboard"] * with_ppl)])
    records = [json.loads(line) for line in log_file.read_text().splitlines()]
    validation = [r for r in records if "valid/lm loss" in r]
    assert [r["iteration"] for r in validation] == [3, 6]
    for record in validation:
        if with_ppl:
            assert record["valid/lm loss ppl"] == pytest.approx(math.exp(record["valid/lm loss"]))
        else:
            assert set(record) == {"iteration", "valid/lm loss"}
    run = load_tool("plot_logs").load_run(log_file)
    assert sorted(run.loss) == [2, 4, 6] and sorted(run.tokens_per_sec) == [3, 6]
