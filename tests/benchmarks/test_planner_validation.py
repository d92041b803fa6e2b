"""Smoke test of the planner-validation benchmark's machinery on a tiny GPT (the timings are not
checked: only that every configuration the planner considers is predicted, trained and reported)."""
import json

from tests.benchmarks import load_benchmark

TINY = ["--world-sizes", "2", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64",
        "--global-batch-size", "4", "--micro-batch-sizes", "2", "--warmup-batches", "1",
        "--measured-batches", "1", "--repeats", "1", "--settle-rounds", "0", "--no-progress"]


bench = load_benchmark("planner_validation")


def test_every_configuration_is_predicted_measured_and_reported(tmp_path, capsys):
    json_path, md_path = tmp_path / "table.json", tmp_path / "table.md"
    bench.main(TINY + ["--json", str(json_path), "--markdown", str(md_path),
                       "--profile-cache", str(tmp_path / "cache"),
                       "--settle-rounds", "1", "--settle-margin", "100"])  # all contend
    report = json.loads(json_path.read_text())
    rows = report["rows"]
    # world 2, b = 2 of a batch of 4: (t, p, d) in (1,1,2), (2,1,1) under Flush (one stage), and
    # (1,2,1) under each schedule the planner offers for this tied model (not pipedream) whose
    # layers do not split into two chunks per stage (not interleaved)
    shapes = {(r["plan"]["tensor_parallel"], r["plan"]["pipeline_parallel"],
               r["plan"]["data_parallel"]) for r in rows}
    assert shapes == {(1, 1, 2), (2, 1, 1), (1, 2, 1)}
    assert {r["plan"]["schedule"] for r in rows if r["plan"]["pipeline_parallel"] == 2} == \
        {"2bw", "flush", "gpipe", "zb-h1"}
    assert len(rows) == 6
    for row in rows:
        assert row["predicted_ms"] > 0 and len(row["measured_ms"]) == 1
        assert row["measured_ms"][0] > 0
        assert abs(row["error"] - (row["predicted_ms"] / row["median_ms"] - 1)) < 1e-9
        assert row["plan"]["simulated"]  # every fitting configuration is replayed
    assert sorted(r["rank_predicted"] for r in rows) == list(range(1, 7))
    assert sorted(r["rank_measured"] for r in rows) == list(range(1, 7))
    assert report["verdicts"]["2"]["configurations"] == 6
    assert sorted(report["orders"][0]) == list(range(6))  # the one round ran every row once
    # then one settling round of every row (a margin of 100x makes them all contenders)
    assert sorted(report["settling"]) == sorted([2, r["config"]] for r in rows)
    [settle_order] = report["settle_orders"]
    assert sorted(settle_order) == list(range(6))
    assert all(len(r["settle_ms"]) == 1 and r["settle_ms"][0] > 0 for r in rows)
    for row in rows:  # each run's measured batch (one here), the repeat's run then the settling's
        assert [len(batches) for batches in row["batch_ms"]] == [1, 1]
        assert row["batch_ms"] == [row["measured_ms"], row["settle_ms"]]
    # the predictions come from inputs sampled once per round: the medians are in the report
    profile = report["profile"]["2"]  # world 2's, as its predictions used it
    assert set(profile) == {"1", "2"} and set(profile["1"]) == {"2"}
    assert profile["1"]["2"]["layer_forward_s"] > 0
    # and every copy of every round, from which the medians came (2 processes profile at once)
    [copies] = report["profile_copies"]["2"]["1"]["2"]  # one round
    assert len(copies) == 2 and all(copy["layer_forward_s"] > 0 for copy in copies)
    assert profile["1"]["2"]["layer_forward_s"] == \
        sum(copy["layer_forward_s"] for copy in copies) / 2  # the median of two
    [start_profile] = report["profiles_at_start"].values()
    assert start_profile["tensor_parallel"]["1"]["2"]["layer_forward_s"] > 0
    assert all(row["predicted_at_start_ms"] > 0 for row in rows)
    hardware = report["hardware"]["2"]
    assert hardware["devices_per_node"] == 2 and hardware["collective_hop_latency_s"] > 0
    [sampled] = report["hardware_rounds"]["2"]  # one round's detection, of which that is the median
    assert sampled["p2p_processor_s"] == hardware["p2p_processor_s"]
    table = md_path.read_text()
    assert table.count("| t=") == 6 and "### 2 processes" in table
    assert "1 settling rounds of 6 contenders" in table
    assert "vocabulary 64" in table and "load average" in table


def test_verdict_names_the_worst_error_and_the_first_choice_gap():
    rows = [bench.Row(2, "a", predicted_ms=100.0, measured_ms=[110.0, 100.0, 90.0]),
            bench.Row(2, "b", predicted_ms=120.0, measured_ms=[95.0]),
            bench.Row(2, "c", predicted_ms=200.0, measured_ms=[150.0])]
    bench.assign_ranks(rows)
    assert [r.rank_predicted for r in rows] == [1, 2, 3]
    assert [r.rank_measured for r in rows] == [2, 1, 3]
    v = bench.verdict(rows)
    assert v["worst_config"] == "c" and abs(v["worst_error"] - (200 / 150 - 1)) < 1e-12
    assert v["within_20_percent"] == 1 and not v["error_target_holds"]  # b: +26%, c: +33%
    assert v["first_choice"] == "a" and v["measured_best"] == "b"
    assert abs(v["first_choice_gap"] - (100 / 95 - 1)) < 1e-12 and v["choice_target_holds"] is False


def test_contenders_are_the_first_choice_and_the_near_fastest():
    first = bench.Row(2, "first", predicted_ms=90.0, measured_ms=[130.0])
    fastest = bench.Row(2, "fastest", predicted_ms=100.0, measured_ms=[100.0])
    near = bench.Row(2, "near", predicted_ms=110.0, measured_ms=[109.0])
    far = bench.Row(2, "far", predicted_ms=95.0, measured_ms=[111.0])
    rows = [first, fastest, near, far]
    assert bench.contenders(rows, 0.10) == [first, fastest, near]  # far: 11% behind
    assert bench.contenders(rows, 0.12) == rows
    alone = bench.Row(2, "alone", predicted_ms=80.0, measured_ms=[90.0])
    assert bench.contenders([alone, far], 0.10) == []  # the first choice is the fastest by far


def test_the_choice_verdict_counts_the_settling_rounds_and_the_error_does_not():
    first = bench.Row(2, "a", predicted_ms=100.0, measured_ms=[110.0, 108.0, 112.0],
                      settle_ms=[100.0, 101.0, 99.0, 100.0])
    rival = bench.Row(2, "b", predicted_ms=105.0, measured_ms=[100.0, 99.0, 101.0],
                      settle_ms=[104.0, 106.0, 103.0, 105.0])
    rows = [first, rival]
    bench.assign_ranks(rows)
    v = bench.verdict(rows)
    assert first.settled_ms == 101.0 and rival.settled_ms == 103.0
    assert v["measured_best"] == "a" and v["first_choice_gap"] == 0.0  # 10% behind without them
    assert abs(v["worst_error"] - (100 / 110 - 1)) < 1e-12  # the main rounds' median only


def test_after_settling_the_measured_best_is_a_contender():
    # the machine slowed during the settling rounds: a non-contender's main-round median would
    # otherwise beat the contenders' medians over every run, which span slower minutes
    first = bench.Row(4, "a", predicted_ms=100.0, measured_ms=[100.0, 100.0, 100.0],
                      settle_ms=[120.0, 120.0, 120.0, 120.0])
    rival = bench.Row(4, "b", predicted_ms=105.0, measured_ms=[95.0, 95.0, 95.0],
                      settle_ms=[118.0, 118.0, 118.0, 118.0])
    outside = bench.Row(4, "c", predicted_ms=110.0, measured_ms=[106.0, 106.0, 106.0])
    assert bench.contenders([first, rival, outside], 0.10) == [first, rival]
    bench.assign_ranks([first, rival, outside])
    assert [r.rank_measured for r in (rival, first, outside)] == [1, 2, 3]
    v = bench.verdict([first, rival, outside])
    assert v["measured_best"] == "b" and abs(v["first_choice_gap"] - (120 / 118 - 1)) < 1e-12


def test_each_round_samples_turn_taking_where_a_world_size_takes_turns(monkeypatch):
    """Every round's profile copies get that round's turn_taking_overhead when some world size's
    ranks take turns on the processors the profile runs on, and only then."""
    monkeypatch.setattr(bench, "on_ranks", lambda world, fn: ["hardware"])
    monkeypatch.setattr(bench, "measure_costs_per_copy",
                        lambda model, precision, sizes, processes:
                        {key: [{"layer_forward_s": 1.0} for _ in range(processes)]
                         for key in sizes})
    asked = []
    monkeypatch.setattr(bench, "measure_turn_taking",
                        lambda model, precision, sizes, processors:
                        asked.append(processors) or {key: 0.25 for key in sizes})
    config = bench.model_config(bench.parse_args(TINY))
    samples = bench.Samples({4: []}, {2: {(1, 2): []}, 1: {(1, 4): []}}, {4: 2, 1: 1},
                            turn_taking={2: 2})
    samples.take(config)
    samples.take(config)
    assert asked == [2, 2]  # once per round, on the 2 processors the 4 ranks share
    assert samples.profile[2][(1, 2)] == [[{"layer_forward_s": 1.0,
                                            "turn_taking_overhead": 0.25}] * 2] * 2
    assert samples.profile[1][(1, 4)] == [[{"layer_forward_s": 1.0}]] * 2
