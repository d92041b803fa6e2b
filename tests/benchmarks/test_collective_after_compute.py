"""Smoke test of the collective-after-compute measurement on 2 gloo ranks (the figures are the
machine's; checked: every size and segment is measured and the back-to-back row is the baseline)."""
import json

import pytest

from tests.benchmarks import load_benchmark

bench = load_benchmark("collective_after_compute")


def test_every_size_and_segment_is_measured_against_back_to_back(tmp_path):
    out = tmp_path / "rows.json"
    rows = bench.main(["--segments-ms", "0.2", "50", "--sizes", "4", "4096", "--calls", "2",
                       "--rounds", "1", "--json", str(out)])
    assert [(r["bytes"], r["segment_s"]) for r in rows] == [
        (4, 0.0), (4, 0.0002), (4, 0.05), (4096, 0.0), (4096, 0.0002), (4096, 0.05)]
    for row in rows:
        assert row["mean_s"] > 0 and row["median_s"] > 0
        if row["segment_s"] == 0.0:
            assert row["extra_mean_s"] == 0.0 and row["extra_median_s"] == 0.0
    # the 50 ms of compute before an all-reduce is not counted in its time (a 4 KB gloo
    # all-reduce takes well under a millisecond here, a few when ranks share cores)
    assert all(r["mean_s"] < 0.04 for r in rows if r["segment_s"] == 0.05)
    assert json.loads(out.read_text())["rows"] == rows


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--world-size", "1"])
    assert "--world-size must be at least 2" in capsys.readouterr().err
