"""benchmarks/planner_published.py: the data file parses, every row is predicted or skipped with a
reason, the errors are computed from the predictions, and docs/planner.md's table is the one the
benchmark generates."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import planner_published as pp  # noqa: E402


@pytest.fixture(scope="module")
def report():
    return pp.run(with_choice=False)


def test_every_row_is_predicted_or_skipped_with_a_reason(report):
    rows = pp.load_rows()
    assert len(rows) == len(report["results"]) >= 15
    assert {r.id for r in rows} >= {"mlm-1.7b", "mlm-462b", "tt-8b-fsdp8", "tt-8b-fsdp128"}
    for row, result in zip(rows, report["results"]):
        assert result["id"] == row.id and result["source"]
        if row.skip:
            assert result["skip"] and result["predicted"] is None
        else:
            assert result["skip"] is None and result["fits"] is not None
            assert result["predicted"] > 0 and result["layout"].startswith(f"t={row.t} p={row.p}")
    # every FP8 row is skipped, and says why
    assert all("FP8" in r["skip"] for r in report["results"] if "float8" in r["id"])


def test_held_out_rows_follow_the_fixed_rule(report):
    rows = pp.load_rows()
    assert [r.held_out for r in rows] == [i % 3 == 2 for i in range(len(rows))]
    assert {"mlm-16b", "mlm-119b", "mlm-462b"} <= {r.id for r in rows if r.held_out}


def test_errors_are_computed_from_the_predictions(report):
    predicted = [r for r in report["results"] if r["skip"] is None]
    for r in predicted:
        assert r["ratio"] == pytest.approx(r["predicted"] / r["measured"])
        assert r["ratio"] == pytest.approx(r["predicted_tflops_per_gpu"]
                                           / r["measured_tflops_per_gpu"])
    held = [abs(r["ratio"] - 1) for r in predicted if r["held_out"]]
    summary = report["summary"]
    assert summary["held_out"]["rows"] == len(held)
    assert summary["held_out"]["median_abs_error"] == pytest.approx(statistics.median(held))
    assert summary["all"]["max_abs_error"] == pytest.approx(
        max(abs(r["ratio"] - 1) for r in predicted))
    assert summary["skipped"] == sum(1 for r in report["results"] if r["skip"])


def test_megatron_tflops_conversion_is_megatrons_formula():
    """The measured TFLOP/s per GPU goes back to the published figure through the count
    72 B s l h^2 (1 + s/6h + V/12hl) (Narayanan et al. 2021, without recomputation)."""
    row = next(r for r in pp.load_rows() if r.id == "mlm-1.7b")
    b, s, l, h, v = row.global_batch, row.seq, row.layers, row.hidden, row.vocab
    expected = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * h * l))
    assert pp.flops_per_token(pp.model_config(row)) * b * s == pytest.approx(expected)


def test_planners_choice_is_reported_beside_the_source_layout():
    row = next(r for r in pp.load_rows() if r.id == "tt-8b-fsdp8")
    result = pp.compare(row, with_choice=True)
    assert result.choice and result.choice_gain > 0
    assert result.choice_tflops_per_gpu == pytest.approx(
        result.predicted_tflops_per_gpu * result.choice_gain)


def test_docs_table_is_generated_from_the_benchmark(report):
    """docs/planner.md's block is what the benchmark writes from the committed JSON, and the
    committed JSON's predictions are this tree's (choices aside, which take minutes)."""
    committed = json.loads((ROOT / "docs" / "planner_published.json").read_text())
    assert pp.docs_block(ROOT / "docs" / "planner.md") == pp.markdown(committed)
    for mine, theirs in zip(report["results"], committed["results"]):
        assert mine["id"] == theirs["id"]
        if mine["predicted"] is not None:
            assert theirs["predicted"] == pytest.approx(mine["predicted"], rel=1e-9)


@pytest.mark.parametrize("mutate, message", [
    (lambda rows: rows[0].pop("measured"), "missing field 'measured'"),
    (lambda rows: rows[0].update(measured={"tflops": 3}), "'measured' must be one of"),
    (lambda rows: rows[0].update(t=3), "t x p x d = "),
    (lambda rows: rows[0].update(schedule="dualpipe"), "'schedule' must be one of"),
    (lambda rows: rows[0].update(skip=""), "'skip' needs a reason"),
])
def test_bad_data_file_is_one_line_and_exit_code_2(tmp_path, mutate, message):
    import yaml
    raw = yaml.safe_load(pp.DATA.read_text())
    mutate(raw["rows"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner_published.py"),
                           "--data", str(bad), "--no-choice"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(bad) in lines[0], done.stderr
