"""Smoke test of the paired receive-ahead benchmark (its timings are not checked here)."""
import pytest

from tests.benchmarks import load_benchmark

bench = load_benchmark("p2p_receive_ahead")


def test_one_pair_is_run_both_ways_and_reported(capsys):
    ratio = bench.main(["--pairs", "1", "--warmup-batches", "1", "--measured-batches", "1",
                        "--pipeline-layer-split", "3,1"])
    out = capsys.readouterr().out
    assert ratio > 0 and "posted with the exchange" in out and "receives ahead take" in out


def test_a_split_that_does_not_fit_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--pipeline-layer-split", "3,2"])
    assert "--pipeline-layer-split needs 2 positive layer counts" in capsys.readouterr().err
