"""Smoke test of the collective-after-compute measurement on 2 gloo ranks, on a virtual clock (the
ranks are forked, so they inherit it): every size and segment is measured, the back-to-back row is
the baseline, and the compute before a call is not counted in its time."""
import json

import pytest

from tests.benchmarks import load_benchmark
from tests.virtual_clock import VirtualClock

bench = load_benchmark("collective_after_compute")


TICK_S = 1e-6  # every clock read: an all-reduce reads as one tick whatever the machine's speed


def test_every_size_and_segment_is_measured_against_back_to_back(tmp_path, monkeypatch):
    clock = VirtualClock(tick=TICK_S)
    monkeypatch.setattr(bench, "time", clock.as_time_module())
    monkeypatch.setattr(bench, "busy_wait", clock.advance)
    out = tmp_path / "rows.json"
    rows = bench.main(["--segments-ms", "0.2", "50", "--sizes", "4", "4096", "--calls", "2",
                       "--rounds", "1", "--json", str(out)])
    assert [(r["bytes"], r["segment_s"]) for r in rows] == [
        (4, 0.0), (4, 0.0002), (4, 0.05), (4096, 0.0), (4096, 0.0002), (4096, 0.05)]
    for row in rows:  # the 50 ms of compute before an all-reduce is not counted in its time
        assert row["mean_s"] == pytest.approx(TICK_S) and row["median_s"] == pytest.approx(TICK_S)
        assert row["extra_mean_s"] == pytest.approx(0.0, abs=1e-12)
        assert row["extra_median_s"] == pytest.approx(0.0, abs=1e-12)
    assert json.loads(out.read_text())["rows"] == rows


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--world-size", "1"])
    assert "--world-size must be at least 2" in capsys.readouterr().err
