"""benchmarks/time_to_quality.py: its smoke mode runs both recipes as real 2-process torchrun jobs
and reads their logs; the training-time arithmetic, the recipes taken from the study and bad
input are checked on their own."""
import json

import pytest

from tests.benchmarks import load_benchmark, write_token_corpus

ttq = load_benchmark("time_to_quality")


def study_json(path, flush_lr=4e-3, ef_lr=2e-3):
    """The part of benchmarks/convergence.py's JSON the recipes come from."""
    path.write_text(json.dumps({
        "setup": {"rules": [{"name": "flush", "schedule": "flush", "compensation": "none"},
                            {"name": "2bw", "schedule": "2bw", "compensation": "none"},
                            {"name": "2bw-ef", "schedule": "2bw", "compensation": "ef"}]},
        "summary": {
            "table": [{"schedule": "flush", "optimizer": "adam", "best_lr": flush_lr,
                       "best_warmup": 0.05},
                      {"schedule": "2bw", "optimizer": "adam", "best_lr": 1e-3,
                       "best_warmup": 0.05},
                      {"schedule": "2bw-ef", "optimizer": "adam", "best_lr": ef_lr,
                       "best_warmup": 0.2}],
            "targets": {"flush_best": {"rule": "flush", "optimizer": "adam"},
                        "2bw_best": {"rule": "2bw-ef", "optimizer": "adam"}}}}))
    return str(path)


def test_the_recipes_are_the_study_best_points(tmp_path):
    flush, other = ttq.recipes_from_study(study_json(tmp_path / "study.json"))
    assert flush == ttq.Recipe("flush", "flush", "none", "adam", 4e-3, 0.05)
    assert other == ttq.Recipe("2bw-ef", "2bw", "ef", "adam", 2e-3, 0.2)
    (tmp_path / "spm.model").write_bytes(b"")  # the quickstart's tokenizer, by name only
    command = ttq.job_command(other, ttq.Setup(iterations=400), str(tmp_path), "log.jsonl")
    flags = " ".join(command)
    assert "--tokenizer-type SentencePieceTokenizer" in flags
    assert "--nproc-per-node 2" in flags and "--pipeline-schedule 2bw" in flags
    assert "--delay-compensation ef" in flags and "--lr-warmup-iters 80" in flags
    assert "--global-batch-size 32" in flags and "--micro-batch-size 16" in flags  # m = 2


def test_training_time_sums_the_log_intervals_and_interpolates_the_target():
    flush = {"valid": {50: 6.0, 100: 5.0}, "time_per_iter_ms": {50: 20.0, 100: 20.0}}
    two = {"valid": {50: 5.5, 100: 4.5}, "time_per_iter_ms": {50: 10.0, 100: 14.0}}
    assert ttq.curve_of(two) == [(0.5, 5.5), (pytest.approx(1.2), 4.5)]
    runs = {"flush": {"log": flush, "curve": ttq.curve_of(flush)},
            "2bw": {"log": two, "curve": ttq.curve_of(two)}}
    summary = ttq.summarize(runs)
    assert summary["flush_training_s"] == pytest.approx(2.0)
    assert summary["2bw_s_to_flush_final"] == pytest.approx(0.85)  # halfway from 0.5 to 1.2
    assert summary["2bw_time_ratio"] == pytest.approx(0.425)
    assert summary["measured_time_per_iter_ratio"] == pytest.approx(12 / 20)
    # p = 2, m = 2, backward = 2 forwards: Flush 3 x 3 units per iteration, 2BW 2 x 3
    assert summary["modelled_time_per_iter_ratio"] == pytest.approx(2 / 3)


def test_smoke_mode_runs_both_recipes_as_real_jobs(tmp_path):
    write_token_corpus(tmp_path)
    out = tmp_path / "ttq.json"
    result = ttq.main(["--smoke", "--data-dir", str(tmp_path), "--study",
                       study_json(tmp_path / "study.json"), "--workdir", str(tmp_path / "runs"),
                       "--json", str(out), "--plot", str(tmp_path / "ttq.png")])
    assert json.loads(out.read_text())["summary"] == result["summary"]
    for key, lr in (("flush", 4e-3), ("2bw", 2e-3)):
        run = result["runs"][key]
        assert run["recipe"]["lr"] == lr
        assert sorted(run["log"]["valid"]) == [2, 4]  # evaluations every 2 of 4 iterations
        times = [t for t, _ in run["curve"]]
        assert 0 < times[0] < times[1]
    assert result["runs"]["2bw"]["recipe"]["compensation"] == "ef"
    assert (tmp_path / "ttq.png").stat().st_size > 0


@pytest.mark.parametrize("problem", ["data", "study"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, problem):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train_text_document.idx").write_bytes(b"")
    args = ["--data-dir", str(tmp_path / "none" if problem == "data" else data),
            "--study", str(tmp_path / "missing.json")]
    with pytest.raises(SystemExit) as exit_info:
        ttq.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("--data-dir" if problem == "data" else "--study") in err
