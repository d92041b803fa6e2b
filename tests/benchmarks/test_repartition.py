"""benchmarks/repartition.py's summary: the repartitioned run against the best static split, as
medians over a phase and round by round (a round's segments share the machine's state)."""
import argparse

from benchmarks.repartition import DYNAMIC, STATIC, summarize


def _segments(phase, rates):
    """rates[copy] = samples/s per round; the best split's rounds drift by 2x."""
    return [{"phase": phase, "round": r, "copy": copy, "split": copy,
             "samples_per_s": rate, "seconds_per_iteration": 8 / rate}
            for copy, per_round in rates.items() for r, rate in enumerate(per_round)]


def test_the_repartitioned_run_is_compared_round_by_round():
    args = argparse.Namespace(move_after=1, segment_iterations=4, rounds=4, heavy_ms=0,
                              layer_wait_ms=0, hidden_size=8)
    drift = [10, 10, 20, 20]  # the machine doubled its speed half-way
    rates = {"1,3": [x * 0.5 for x in drift], "2,2": drift, "3,1": [x * 0.4 for x in drift],
             DYNAMIC: [4, 9, 19, 19.5]}  # moved after round 0, warms up in round 1
    segments = _segments(1, rates) + _segments(2, rates)
    moves = [{"phase": p, "seconds": 0.1} for p in (1, 2)]
    summary = summarize({"segments": segments, "moves": moves}, args)
    phase = summary["phases"][1]
    assert phase["best_static_split"] == "2,2" and set(phase["static"]) == set(STATIC)
    by_round = phase["after_vs_best_by_round"]
    assert by_round["rounds"] == 2
    assert abs(by_round["min"] - 0.95) < 1e-9 and abs(by_round["max"] - 0.975) < 1e-9
    # the phase medians set the run's fast rounds against all of the split's: 128%
    assert abs(phase["after_vs_best"] - 19.25 / 15) < 1e-9
