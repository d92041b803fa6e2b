import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_2bw.config import LoggingConfig
from megatron_2bw.logging import TrainingLogger

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "plot_logs.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _load_tool():
    spec = importlib.util.spec_from_file_location("plot_logs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


plot_logs = _load_tool()


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _synthetic_run(path: Path, start_loss: float, speed: float) -> Path:
    return _write_jsonl(path, [{"text": "config", "value": "{}"}] + [
        {"iteration": i, "lm loss": start_loss / i, "tokens-per-sec": speed + i}
        for i in range(1, 21)])


def test_png_from_two_jsonl_runs(tmp_path):
    run_a = _synthetic_run(tmp_path / "a.jsonl", 10.0, 900.0)
    run_b = _synthetic_run(tmp_path / "b.jsonl", 12.0, 1200.0)
    output = tmp_path / "plots" / "curves.png"
    assert plot_logs.main([str(run_a), str(run_b), "--output", str(output),
                           "--labels", "baseline", "2bw"]) == 0
    assert output.read_bytes().startswith(PNG_SIGNATURE) and output.stat().st_size > 10_000


def test_resumed_run_keeps_last_record_per_iteration(tmp_path):
    log = _write_jsonl(tmp_path / "run.jsonl", [
        {"iteration": 1, "lm loss": 5.0}, {"iteration": 2, "lm loss": 4.0},
        {"iteration": 2, "lm loss": 3.5}, {"iteration": 3, "lm loss": 3.0}])
    curves = plot_logs.load_run(log)
    assert curves.loss_key == "lm loss"
    assert curves.loss == {1: 5.0, 2: 3.5, 3: 3.0}
    assert curves.tokens_per_sec == {}


def test_directories_of_jsonl_and_tensorboard_events(tmp_path):
    config = LoggingConfig(tensorboard_dir=str(tmp_path / "tb"),
                           log_file=str(tmp_path / "jsonl" / "log.jsonl"))
    with TrainingLogger(config, True, {}) as logger:
        for iteration in (1, 2, 3):
            logger.log(iteration, {"lm loss": 4.0 - iteration, "tokens-per-sec": 100.0 * iteration})
    for directory in ("tb", "jsonl"):
        curves = plot_logs.load_run(tmp_path / directory)
        assert curves.loss == pytest.approx({1: 3.0, 2: 2.0, 3: 1.0})
        assert curves.tokens_per_sec == pytest.approx({1: 100.0, 2: 200.0, 3: 300.0})
    output = tmp_path / "mixed.png"
    assert plot_logs.main([str(tmp_path / "tb"), str(tmp_path / "jsonl" / "log.jsonl"),
                           "--output", str(output)]) == 0
    assert output.read_bytes().startswith(PNG_SIGNATURE)


def test_missing_file_is_a_one_line_error_with_exit_2(tmp_path):
    missing = tmp_path / "nope.jsonl"
    result = subprocess.run([sys.executable, str(SCRIPT), str(missing), "--output",
                             str(tmp_path / "x.png")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"plot_logs.py: error: {missing}: no such file or directory "
                                     f"(expected a --log-file JSON-lines file or a directory of "
                                     f"*.jsonl or TensorBoard event files)")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("records, expected", [
    ([{"text": "config", "value": "{}"}], "no loss records"),
    ([{"iteration": 1, "tokens-per-sec": 5.0}], "found: tokens-per-sec"),
])
def test_file_without_loss_records_is_an_error(tmp_path, capsys, records, expected):
    log = _write_jsonl(tmp_path / "no_loss.jsonl", records)
    assert plot_logs.main([str(log), "--output", str(tmp_path / "x.png")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"plot_logs.py: error: {log}: no loss records") and expected in error


def test_bad_inputs_name_the_problem(tmp_path, capsys):
    (tmp_path / "empty_dir").mkdir()
    assert plot_logs.main([str(tmp_path / "empty_dir")]) == 2
    assert "no *.jsonl log files or TensorBoard event files" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"iteration": 1, "lm loss": 2.0}\n{"iteration": 2,\n')
    assert plot_logs.main([str(broken)]) == 2
    assert f"{broken}:2: not a JSON object" in capsys.readouterr().err
    run = _synthetic_run(tmp_path / "a.jsonl", 1.0, 1.0)
    assert plot_logs.main([str(run), "--labels", "x", "y"]) == 2
    assert "--labels got 2 labels for 1 runs" in capsys.readouterr().err
