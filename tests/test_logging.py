import json
import os
import time

import pytest

from megatron_2bw import logging as logging_module
from megatron_2bw.config import LoggingConfig
from megatron_2bw.distributed.forked import run_forked
from megatron_2bw.logging import (TIMER_NAMES, Timers, TimersAcrossRanks, TrainingLogger,
                                  format_log_line, measured_bubble_fraction, wandb_mode)
from tests.virtual_clock import VirtualClock

METRICS = [{"lm loss": 9.5, "learning-rate": 1e-4, "tokens-per-sec": 1000.0},
           {"lm loss": 8.25, "learning-rate": 2e-4, "tokens-per-sec": 1100.0},
           {"lm loss": 7.0, "learning-rate": 3e-4, "tokens-per-sec": 1200.0}]


def _log_three(logger: TrainingLogger) -> None:
    for iteration, metrics in enumerate(METRICS, 1):
        logger.log(iteration, metrics)


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """No API key anywhere: no env key, no mode, and a HOME without a netrc."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return home


def test_tensorboard_scalars_and_text_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tb"
    with TrainingLogger(LoggingConfig(tensorboard_dir=str(tb_dir)), True, {"lr": 3e-4}) as logger:
        _log_three(logger)
        logger.log_text("plan", "stage 0: layers 0-1")

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"lm loss", "learning-rate", "tokens-per-sec"}
    loss = events.Scalars("lm loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([9.5, 8.25, 7.0])
    text_tags = events.Tags()["tensors"]
    assert "config/text_summary" in text_tags and "plan/text_summary" in text_tags
    plan = events.Tensors("plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "stage 0: layers 0-1" in plan


def test_wandb_is_offline_without_api_key_and_writes_its_run(tmp_path, no_wandb_login):
    assert wandb_mode() == "offline"
    save_dir = tmp_path / "wandb-runs"
    config = LoggingConfig(wandb_project="tiny-gpt", wandb_exp_name="run-a",
                           wandb_save_dir=str(save_dir))
    with TrainingLogger(config, True, {"num_layers": 2}) as logger:
        _log_three(logger)
        logger.log_text("plan", "stage 0: layers 0-1")
    run_dirs = list((save_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    run_files = list(run_dirs[0].glob("run-*.wandb"))
    assert len(run_files) == 1 and run_files[0].stat().st_size > 0


def test_wandb_mode_online_with_a_key_and_env_override(no_wandb_login, monkeypatch):
    (no_wandb_login / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    (no_wandb_login / ".netrc").chmod(0o600)
    assert wandb_mode() == "online"
    (no_wandb_login / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_wandb_failure_warns_once_and_training_logs_go_on(tmp_path, monkeypatch, capsys):
    import wandb

    def failing_init(**kwargs):
        raise RuntimeError("no route to host")

    monkeypatch.setattr(wandb, "init", failing_init)
    log_file = tmp_path / "log.jsonl"
    config = LoggingConfig(wandb_project="p", log_file=str(log_file))
    with TrainingLogger(config, True, {}) as logger:
        _log_three(logger)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "Weights & Biases" in line]
    assert len(warnings) == 1 and "no route to host" in warnings[0]
    assert len(log_file.read_text().splitlines()) == 3


def test_jsonl_records_read_back_and_a_resumed_run_appends(tmp_path):
    log_file = tmp_path / "logs" / "run.jsonl"
    config = LoggingConfig(log_file=str(log_file))
    with TrainingLogger(config, True, {}) as logger:
        _log_three(logger)
        logger.log_text("plan", "p=2")
    with TrainingLogger(config, True, {}) as logger:
        logger.log(4, {"lm loss": 6.5})
    records = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert records[0] == {"iteration": 1, **METRICS[0]}
    assert records[3] == {"text": "plan", "value": "p=2"}
    assert records[4] == {"iteration": 4, "lm loss": 6.5}


def test_non_writer_rank_writes_nothing(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setattr(wandb, "init", lambda **kwargs: pytest.fail("non-writer started wandb"))
    config = LoggingConfig(tensorboard_dir=str(tmp_path / "tb"), wandb_project="p",
                           log_file=str(tmp_path / "log.jsonl"))
    with TrainingLogger(config, False, {}) as logger:
        _log_three(logger)
        logger.log_text("plan", "x")
    assert list(tmp_path.iterdir()) == []


def test_timers_respect_levels_accumulate_and_reset(monkeypatch):
    clock = VirtualClock()
    monkeypatch.setattr(logging_module, "time", clock.as_time_module())
    sync_calls = []
    timers = Timers(log_level=1, synchronize=lambda: sync_calls.append(1))
    timers("detail", level=2).start()  # above the level: a no-op
    clock.advance(1.0)
    timers("detail", level=2).stop()
    for _ in range(2):
        timers("forward").start()
        clock.advance(0.01)
        timers("forward").stop()
        clock.advance(5.0)  # between intervals: not counted
    timers("batch", level=0).start()
    summary = timers.summary()
    assert set(summary) == {"forward", "batch"}
    assert summary["forward"] == pytest.approx(0.02)
    assert len(sync_calls) >= 5  # every clock read waits for the device
    assert timers.summary()["forward"] == 0.0  # reset by the first summary
    clock.advance(0.25)
    assert timers("batch", level=0).elapsed(reset=False) == pytest.approx(0.25)  # still running
    clock.advance(0.25)
    assert timers("batch", level=0).elapsed() == pytest.approx(0.5)
    assert timers("batch", level=0).elapsed() == 0.0  # keeps running from the reset
    with pytest.raises(RuntimeError, match="already running"):
        timers("batch", level=0).start()
    with pytest.raises(RuntimeError, match="without being started"):
        timers("optimizer").stop()
    assert Timers(log_level=0)("forward").elapsed() == 0.0


def test_measured_bubble_fraction():
    summary = {"forward": 0.3, "backward": 0.5, "optimizer": 0.1, "p2p-wait": 0.05}
    assert measured_bubble_fraction(summary, 1.0) == pytest.approx(0.1)
    assert measured_bubble_fraction(summary, 0.5) == 0.0  # clamped, overlapping timers
    with pytest.raises(ValueError, match="timing-log-level"):
        measured_bubble_fraction({"forward": 0.3}, 1.0)
    with pytest.raises(ValueError, match="batch_time"):
        measured_bubble_fraction(summary, 0.0)


def _timer_block_lines(text: str) -> dict[str, tuple[float, float]]:
    return {line.split(" .")[0].strip(): tuple(map(float, line.split(": (")[1][:-1].split(", ")))
            for line in text.splitlines() if line.startswith("    ")}


def test_timers_of_one_process_print_at_once_with_min_equal_to_max(capsys):
    report = TimersAcrossRanks(None, is_writer=True)
    report.submit(1, 10, {"forward": 12.5, "backward": 20.25})
    out = capsys.readouterr().out
    assert out.startswith(" (min, max) time across ranks (ms per iteration, iterations 1-10):")
    figures = _timer_block_lines(out)
    assert list(figures) == list(TIMER_NAMES)  # every timer, absent ones at 0
    assert figures["forward"] == (12.5, 12.5) and figures["backward"] == (20.25, 20.25)
    assert figures["p2p-wait"] == (0.0, 0.0)
    TimersAcrossRanks(None, is_writer=False).submit(1, 10, {"forward": 1.0})
    assert capsys.readouterr().out == ""  # only the writer prints


def _submit_without_waiting(rank, world, go_ahead):
    """Rank 1 submits only once rank 0 has submitted and looked at what is pending (or after a
    minute): rank 0's submit and print_ready must not wait for it."""
    import torch.distributed as dist
    report = TimersAcrossRanks(dist.new_group(backend="gloo"), is_writer=rank == 0)
    told = None
    if rank == 1:
        deadline = time.monotonic() + 60  # only a broken submit makes rank 1 wait this long
        while not os.path.exists(go_ahead) and time.monotonic() < deadline:
            time.sleep(0.01)
        told = os.path.exists(go_ahead)
    report.submit(1, 5, {"forward": 10.0 * (rank + 1), "optimizer": 1.0 + rank})
    pending_then = len(report._pending)
    if rank == 0:
        open(go_ahead, "w").close()
    report.submit(6, 10, {"forward": 5.0})
    report.finish()
    return told, pending_then


def test_timers_across_ranks_are_exchanged_without_blocking_and_printed_in_order(capfd, tmp_path):
    (_, pending), (told, _) = run_forked(2, _submit_without_waiting, str(tmp_path / "go"),
                                         timeout=180)
    assert told  # rank 0's submit returned before rank 1 had submitted
    assert pending == 1  # nor did the print wait: the interval was still out
    out = capfd.readouterr().out
    blocks = out.split(" (min, max) time across ranks")[1:]
    assert [b.split("iterations ")[1].split(")")[0] for b in blocks] == ["1-5", "6-10"]
    first = _timer_block_lines(blocks[0])
    assert first["forward"] == (10.0, 20.0) and first["optimizer"] == (1.0, 2.0)
    assert first["backward"] == (0.0, 0.0)
    assert _timer_block_lines(blocks[1])["forward"] == (5.0, 5.0)


def test_format_log_line_shows_present_metrics_and_eta():
    line = format_log_line(10, 100, {"consumed-samples": 40, "learning-rate": 3e-4,
                                     "lm loss": 7.25, "grad-norm": 1.5, "tokens-per-sec": 12345.4,
                                     "tflops": 1.234, "mem-peak-bytes": 3 * 2**20,
                                     "skipped-iterations": 1.0, "num-zeros": 3.0,
                                     "params-norm": 45.25}, 0.5)
    assert line.startswith(" iteration   10/ 100 | consumed samples:")
    for expected in ["elapsed time per iteration (ms): 500.0", "learning rate: 3.000E-04",
                     "lm loss: 7.250000E+00", "grad norm: 1.500", "num zeros: 3",
                     "params norm: 45.250", "tokens/s: 12345",
                     "TFLOP/s: 1.23", "mem: 3.0 MiB", "skipped iterations: 1", "ETA 0:00:45"]:
        assert expected in line
    assert "TFLOP/s: 0.000123" in format_log_line(1, 2, {"tflops": 1.23e-4}, 1.0)
    short = format_log_line(3, 4, {"lm loss": 2.0}, 2.0)
    assert "learning rate" not in short and "tokens/s" not in short and "mem:" not in short
    assert "params norm" not in short and "num zeros" not in short
    assert short.endswith("ETA 0:00:02")

