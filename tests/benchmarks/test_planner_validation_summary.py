"""The summary of saved planner validation reports: pooled verdicts, per-configuration residuals,
and predictions recomputed from a report's own inputs."""
import json

import pytest

from tests.benchmarks import load_benchmark
from tests.benchmarks.test_planner_validation import TINY

summary = load_benchmark("planner_validation_summary")


def _report(path, rows):
    path.write_text(json.dumps({"header": "GPT: synthetic", "rows": [
        {"world_size": world, "config": config, "predicted_ms": predicted, "measured_ms": measured}
        for world, config, predicted, measured in rows]}))
    return path


def test_residuals_separate_a_run_s_drift_from_a_configuration_s_error(tmp_path, capsys):
    # run 1 is slow (everything 20% under-predicted), run 2 fast; "a" is 10% worse than its run
    # in both, "b" and "c" follow their run
    slow = _report(tmp_path / "slow.json", [(2, "a", 70.0, [100.0]), (2, "b", 80.0, [100.0]),
                                            (2, "c", 160.0, [200.0])])
    fast = _report(tmp_path / "fast.json", [(2, "a", 100.0, [100.0]), (2, "b", 110.0, [100.0]),
                                            (2, "c", 220.0, [200.0])])
    verdicts, by_config = summary.main([str(slow), str(fast)])
    assert [v.median_error for v in verdicts] == pytest.approx([-0.2, 0.1])
    assert by_config[(2, "a")]["residuals"] == pytest.approx([-0.1, -0.1])
    assert by_config[(2, "b")]["residuals"] == pytest.approx([0.0, 0.0])
    # the first choice: "a" (predicted fastest) measured as fast as "b", the best
    assert all(v.verdict["choice_target_holds"] for v in verdicts)
    assert verdicts[0].verdict["within_20_percent"] == 2  # a: -30%
    out = capsys.readouterr().out
    assert "Pooled: 5 of 6 predictions within 20%" in out
    assert "every target held in 1 of 2 reports" in out
    line = next(line for line in out.splitlines() if "| a |" in line)
    assert "-10.0% | -10.0%, -10.0% | yes |" in line


def test_repredict_reproduces_a_run_s_predictions_from_its_report(tmp_path, capsys):
    validation = load_benchmark("planner_validation")
    path = tmp_path / "run.json"
    validation.main(TINY + ["--json", str(path), "--profile-cache", str(tmp_path / "cache")])
    report = json.loads(path.read_text())
    rows = summary.load_rows(path)
    for row in rows:
        row.predicted_ms = -1.0
    summary.repredict(path, rows)  # the model of this checkout: the run's own predictions
    assert [row.predicted_ms for row in rows] == \
        pytest.approx([row["predicted_ms"] for row in report["rows"]], rel=1e-12)


@pytest.mark.parametrize("content,flags,message", [
    (None, [], "no such file"),
    ("{}", [], "not a report of benchmarks/planner_validation.py --json"),
    ('{"header": "GPT: x", "rows": []}', ["--repredict"], "keeps no sampled inputs"),
])
def test_bad_reports_are_one_line_errors(tmp_path, capsys, content, flags, message):
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        summary.main(flags + [str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("planner_validation_summary.py: error: ") and message in err
    assert "\n" not in err
