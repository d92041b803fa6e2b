"""Smoke test of the exposed-communication benchmark on 2 gloo ranks and a tiny model: every
configuration is measured, the exposed time is the reduction's timer plus the all-gather waits,
and only the distributed optimizer waits for all-gathers."""
import json

from tests.benchmarks import load_benchmark

bench = load_benchmark("exposed_communication")


def test_every_configuration_is_measured(tmp_path):
    out = tmp_path / "exposed.json"
    result = bench.main(["--layers", "1", "--hidden", "64", "--vocab", "256", "--seq-length", "8",
                         "--microbatches", "2", "--batches", "1", "--rounds", "1",
                         "--bucket-elements", "4000", "--schedules", "flush", "--json", str(out)])
    rows = result["rows"]
    assert [(r["averaging"], r["mode"]) for r in rows] == [
        (a, m) for a in bench.AVERAGING for m in bench.MODES]
    for row in rows:
        exposed, parts = row["exposed_ms"], (row["allreduce_ms"], row["gather_ms"])
        assert exposed["min"] > 0 and row["batch_ms"]["min"] > exposed["max"]
        # each sample's exposed time is the sum of its parts
        assert max(p["min"] for p in parts) <= exposed["min"]
        assert exposed["max"] <= sum(p["max"] for p in parts) + 1e-9
        assert (row["gather_ms"]["max"] > 0) == (row["averaging"] == "distributed-optimizer")
    assert json.loads(out.read_text()) == result
