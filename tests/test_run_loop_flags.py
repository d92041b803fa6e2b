"""Megatron-LM's run-loop and logging flags: --manual-gc, --empty-unused-memory-level,
--deterministic-mode, --tensorboard-log-interval, --log-timers-to-tensorboard,
--log-validation-ppl-to-tensorboard and --profile. The runs are tiny GPTs on forked gloo ranks."""
import gc
import json
import math
import os
import re

import pytest
import torch

from megatron_2bw import training
from megatron_2bw.arguments import parse_config
from megatron_2bw.config import Config, LoggingConfig, TrainingConfig
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.logging import IterationProfiler, Timers
from megatron_2bw.pipeline.update import StepResult
from tests.data.helpers import load_tool
from tests.distributed_helpers import run_ranks

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "16", "--micro-batch-size", "2", "--mock-data", "--vocab-size", "64", "--eval-iters", "1",
        "--train-iters", "6", "--eval-interval", "3", "--log-interval", "1"]


def _pretrain(rank, world, flags):
    training.pretrain(parse_config(flags)[0])


def _pretrain_recording(rank, world, flags):
    """pretrain(flags) on this forked rank, recording in order each collection, each step (its
    iteration, whether the collector and deterministic algorithms are on) and each evaluation;
    returns the events and whether the collector is on afterwards."""
    gc.freeze()  # collections leave out the heap inherited from pytest: seconds each otherwise
    events = []
    collect, step, evaluate = gc.collect, training.ProgressLog.__call__, training.evaluate

    def recording_collect(generation=2):
        events.append(("collect", generation))
        return collect(generation)

    def recording_step(log, result):
        events.append(("step", result.batch + 1, gc.isenabled(),
                       torch.are_deterministic_algorithms_enabled()))
        step(log, result)

    def recording_evaluate(*args, **kwargs):
        events.append(("evaluate", gc.isenabled()))
        return evaluate(*args, **kwargs)

    gc.collect = recording_collect  # the forked rank's own modules: nothing to restore
    training.ProgressLog.__call__ = recording_step
    training.evaluate = recording_evaluate
    _pretrain(rank, world, flags)
    return events, gc.isenabled()


def _steps(gc_on: bool, *iterations: int) -> list:
    return [("step", i, gc_on, False) for i in iterations]


FULL, YOUNGEST = ("collect", 2), ("collect", 0)
# validation after iterations 3 and 6, then the test split once training is complete (the
# collector is back on by then)
AUTOMATIC_GC = _steps(True, 1, 2, 3) + [("evaluate", True)] + _steps(True, 4, 5, 6) + [
    ("evaluate", True), ("evaluate", True)]


@pytest.mark.parametrize("flags,expected", [
    ([], AUTOMATIC_GC),
    (["--manual-gc", "--manual-gc-interval", "2"],
     [FULL, *_steps(False, 1, 2), FULL, *_steps(False, 3), FULL, ("evaluate", False), YOUNGEST,
      *_steps(False, 4), FULL, *_steps(False, 5, 6), FULL, FULL, ("evaluate", False), YOUNGEST,
      FULL, ("evaluate", True), YOUNGEST]),
    (["--manual-gc", "--no-manual-gc-eval"],
     [FULL, *_steps(False, 1, 2, 3), ("evaluate", False), *_steps(False, 4, 5, 6),
      ("evaluate", False), ("evaluate", True)]),
], ids=["automatic", "manual-every-2", "manual-not-around-evaluation"])
def test_manual_gc_collects_only_at_the_interval_and_around_evaluation(flags, expected):
    events, gc_on_after = run_ranks(1, _pretrain_recording, [*TINY, *flags])[0]
    assert events == expected
    assert gc_on_after  # the collector is back on once training ends


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_mode_is_on_from_setup(deterministic, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the forked rank inherits it

    def run(rank, world, flags):
        events, _ = _pretrain_recording(rank, world, flags)
        return ({on for kind, *rest in events if kind == "step" for on in rest[2:]},
                os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    modes, cublas = run_ranks(1, run, [*TINY, *(["--deterministic-mode"] * deterministic)])[0]
    assert modes == {deterministic}
    assert cublas == (":4096:8" if deterministic else None)


@pytest.mark.parametrize("level,device,emptied", [
    (0, "cuda", []), (1, "cuda", ["step"]), (2, "cuda", ["step", "evaluation"]),
    (2, "cpu", []),  # nothing to empty without CUDA
])
def test_empty_unused_memory_level_empties_the_cuda_cache(level, device, emptied, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(moment))
    housekeeping = training.MemoryHousekeeping(
        TrainingConfig(empty_unused_memory_level=level), torch.device(device))
    moment = "step"
    housekeeping.after_step(1)
    moment = "evaluation"
    with housekeeping.around_evaluation():
        pass
    assert calls == emptied


# -- the sinks -----------------------------------------------------------------------------------

def _log_six_iterations(tmp_path, monkeypatch, timers: Timers, **logging_fields) -> list[dict]:
    """ProgressLog over iterations 1-6 (--log-interval 3; iteration i's loss is i, iteration 4's
    step skipped) writing a --log-file; its records."""
    config = Config(logging=LoggingConfig(log_file=str(tmp_path / "log.jsonl"), **logging_fields))
    config.training.log_interval, config.training.train_iters = 3, 6
    config.training.global_batch_size = 4
    monkeypatch.setattr(training.time, "perf_counter", lambda: 0.0)
    log = training.ProgressLog(config, ParallelLayout(1, 1, 1), timers, 0)
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
    run_ranks(2, _pretrain, [*TINY, "--pipeline-model-parallel-size", "2", "--global-batch-size",
                             "8", "--log-interval", "2", "--timing-log-level", "1",
                             "--eval-interval", "6"], timeout=120)
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
    run_ranks(1, _pretrain, [*TINY, "--log-interval", "3", "--tensorboard-log-interval", "2",
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


# -- --profile -----------------------------------------------------------------------------------

def test_the_pipeline_drains_at_the_profiled_windows_bounds():
    config = parse_config([*TINY, "--eval-interval", "100", "--train-iters", "8"])[0]
    assert training.segment_ends(config, 0) == [8]
    config.logging.profile, config.logging.profile_step_start = True, 2
    assert training.segment_ends(config, 0) == [2, 8]  # the default end, 12, is past the run
    config.logging.profile_step_end = 5
    assert training.segment_ends(config, 0) == [2, 5, 8]
    assert training.segment_ends(config, 3) == [5, 8]  # resumed inside the window


def test_profiler_traces_whole_iterations_on_the_requested_rank_only(tmp_path, capfd):
    """2BW over two stages, 2 microbatches a batch; rank 1 (the last stage) profiles iterations
    [2, 4): all of their steps and transfers, and no other iteration's (no evaluation falls
    inside the window: it would be in the trace too)."""
    tensorboard = tmp_path / "tb"
    run_ranks(2, _pretrain, [*TINY, "--eval-interval", "6", "--pipeline-model-parallel-size", "2",
                             "--global-batch-size",
                             "4", "--profile", "--profile-step-start", "2", "--profile-step-end",
                             "4", "--profile-ranks", "1", "--tensorboard-dir", str(tensorboard)])
    trace = tensorboard / "profile_rank1_iter2-4.pt.trace.json"
    assert sorted(p.name for p in tensorboard.glob("profile_*")) == [trace.name]
    assert f"[rank 1] profile of iterations [2, 4) (the log's 3 to 4) written to {trace}" in \
        capfd.readouterr().out
    names = [event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]]
    assert sum(name.startswith("Optimizer.step#") for name in names) == 2
    assert names.count("c10d::recv_") == 4  # each microbatch's activations
    assert names.count("c10d::send") == 4  # and its input's gradient


def test_a_run_that_ends_inside_the_window_writes_its_trace_beside_the_log_file(tmp_path):
    config = LoggingConfig(profile=True, profile_step_start=2, profile_step_end=6,
                           log_file=str(tmp_path / "logs" / "log.jsonl"))
    assert not IterationProfiler(config, 1, "cpu").enabled  # --profile-ranks: only rank 0
    profiler = IterationProfiler(config, 0, "cpu")
    profiler.begin_segment(1)  # before the window
    profiler.end_segment(2)
    profiler.begin_segment(2)
    torch.ones(3).sum()
    profiler.end_segment(3)  # still inside
    assert not (tmp_path / "logs").exists()
    profiler.finish(3)
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["profile_rank0_iter2-3.pt.trace.json"]
