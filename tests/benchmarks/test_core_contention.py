"""Smoke test of the core contention benchmark (its timings are not checked here)."""
import json

import pytest

from tests.benchmarks import load_benchmark

bench = load_benchmark("core_contention")


def test_each_kernel_is_measured_alone_and_on_every_core(tmp_path, capsys):
    out = tmp_path / "contention.json"
    results = bench.main(["--sides", "16", "32", "--stream-side", "64", "--rounds", "2",
                          "--seconds", "0.02", "--cores", "2", "--json", str(out)])
    assert [(r["kind"], r["side"], r["unit"]) for r in results] == \
        [("matmul", 16, "GFLOP/s"), ("matmul", 32, "GFLOP/s"), ("stream", 64, "GB/s")]
    for r in results:
        assert len(r["rounds"]) == 2 and r["median_alone_rate"] > 0
        assert r["median_together_rate"] > 0 and r["working_set_bytes"] == 3 * r["side"] ** 2 * 4
        first = r["rounds"][0]
        assert abs(first["slowdown"] - (first["alone_rate"] / first["together_rate"] - 1)) < 1e-9
    assert json.loads(out.read_text())["results"][2]["kind"] == "stream"
    assert "2 cores at once" in capsys.readouterr().out


def test_more_cores_than_allowed_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--cores", "4096"])
    assert "--cores must be between 2 and" in capsys.readouterr().err
