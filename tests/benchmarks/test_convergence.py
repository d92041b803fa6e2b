"""benchmarks/convergence.py: its simulated 2BW rules (none, predict, dc) and PipeDream's equal the
references that the multi-process runs are checked against (tests/pipeline/compensation_reference.py,
tests/pipeline/reference.py), and its quick mode writes the result, the table and the picture."""
import dataclasses
import json

import numpy as np
import pytest

from megatron_2bw.data.indexed import IndexedDatasetBuilder
from megatron_2bw.distributed.layout import ParallelLayout
from tests.benchmarks import load_benchmark
from tests.pipeline.compensation_reference import compensated_reference
from tests.pipeline.harness import gpt_feed, max_difference, tiny_config
from tests.pipeline.pipemare_reference import pipemare_reference
from tests.pipeline.reference import per_stage_delay_reference

convergence = load_benchmark("convergence")


@pytest.mark.parametrize("mode", ["none", "predict", "dc"])
def test_the_simulated_2bw_rules_equal_the_reference(mode):
    config = tiny_config(optimizer="adam", lr=0.01, clip=0.5)
    config.optimizer.weight_decay = 0.0  # the reference puts every parameter in one group
    feed = gpt_feed(config, ParallelLayout(1, 1, 1))
    rule = convergence.Rule("2bw", "2bw", delay="uniform", compensation=mode, dc_lambda=5000.0)
    sim = convergence.Simulation(rule, 0.01, convergence.Study(), config.model, config.optimizer)
    for b in range(5):
        sim.step(b, [feed(b * 4 + j)["tokens"] for j in range(4)])
    names = [n for n, _ in sim.model.named_parameters()]
    simulated = {n: m.detach() for n, m in zip(names, sim.master)}
    expected = compensated_reference(config, 5, feed, 4, mode, dc_lambda=5000.0)
    assert max_difference(simulated, expected, config.model.vocab_size) < 1e-5


def test_the_simulated_pipedream_rule_equals_the_per_stage_delay_reference():
    config = tiny_config(optimizer="adam", lr=0.01, clip=0.5,
                         untie_embeddings_and_output_weights=True)
    config.optimizer.weight_decay = 0.0
    feed = gpt_feed(config, ParallelLayout(1, 1, 1))
    rule = next(r for r in convergence.RULES if r.name == "pipedream")
    sim = convergence.Simulation(rule, 0.01, convergence.Study(), config.model, config.optimizer)
    for b in range(6):
        sim.step(b, [feed(b * 4 + j)["tokens"] for j in range(4)])
    simulated = {n: m.detach() for (n, _), m in zip(sim.model.named_parameters(), sim.master)}
    expected = per_stage_delay_reference(config, 6, feed, 4, "pipedream", 4, clip="stage")
    assert max_difference(simulated, expected, config.model.vocab_size) < 1e-5
    assert max_difference(simulated, per_stage_delay_reference(config, 6, feed, 4, "2bw", 4),
                          config.model.vocab_size) > 1e-4


def test_quick_mode_writes_the_result_and_the_picture(tmp_path, capsys):
    """Every rule runs through the whole path (simulation, timing replay, summary, plot) on a
    small generated corpus standing in for the prepared Shakespeare data: Flush at both rates,
    every rule on both seeds at Flush's better rate, every rule at the other rate."""
    rng = np.random.RandomState(0)
    for split, documents in (("train", 4), ("valid", 2)):
        builder = IndexedDatasetBuilder(str(tmp_path / f"{split}_text_document"), np.uint16)
        for _ in range(documents):
            tokens = rng.randint(0, 256, size=2000)
            builder.add_document(tokens, [len(tokens)])
        builder.finalize()
    out = tmp_path / "convergence.json"
    convergence.main(["--quick", "--data-dir", str(tmp_path), "--json", str(out),
                      "--plot", str(tmp_path / "convergence.png")])
    result = json.loads(out.read_text())
    flush_lr = result["summary"]["flush_best_lr"]
    runs = {(r["rule"], r["lr"], r["seed"]) for r in result["runs"]}
    names = {r.name for r in convergence.RULES}
    equal_time = {r.name for r in convergence.RULES if r.equal_time}
    assert equal_time  # the recipe's equal-time run: at Flush's rate only, no sweep
    assert runs == {(n, flush_lr, s) for n in names for s in (1234, 1235)} | \
        {(n, lr, 1234) for n in names - equal_time for lr in (1e-3, 2e-3)}
    seconds = result["time_per_sample_s"]
    longer = int(4 * seconds["flush"] / seconds["2bw"])  # the updates 2BW fits in Flush's time
    for run in result["runs"]:
        updates = longer if run["rule"] in equal_time else 4
        assert run["iterations"] == updates
        # before, every 2 updates, and after the last
        assert [s for s, _ in run["curve"]] == [0, *range(8, 4 * updates + 1, 8),
                                                *([4 * updates] if updates % 2 else [])]
    # the flushed schedules fill and drain every batch, 2BW once per segment
    assert min(seconds["gpipe"], seconds["flush"]) > seconds["2bw"] > 0
    assert (tmp_path / "convergence.png").stat().st_size > 0
    assert "| 2bw-predict |" in capsys.readouterr().out


def _run(rule, lr, seed, finals, samples=(0, 8, 16)):
    return {"rule": rule, "lr": lr, "seed": seed,
            "curve": [[s, loss] for s, loss in zip(samples, finals)]}


def test_the_summary_compares_seed_by_seed_at_flush_best_rate():
    rules = [convergence.Rule("flush", "flush"), convergence.Rule("2bw", "2bw", delay="uniform")]
    study = convergence.Study(lrs=(1e-3, 2e-3), seeds=2, rules=rules)
    runs = [_run("flush", 1e-3, 1234, [9, 7, 6.0]), _run("flush", 2e-3, 1234, [9, 7, 5.0]),
            _run("flush", 2e-3, 1235, [9, 7, 5.5]),
            _run("2bw", 2e-3, 1234, [9, 7.5, 5.05]), _run("2bw", 2e-3, 1235, [9, 8, 6.05]),
            _run("2bw", 1e-3, 1234, [9, 7, float("nan")])]
    summary = convergence.summarize(runs, {"flush": 2.0, "gpipe": 2.0, "2bw": 1.0}, study)
    assert summary["flush_best_lr"] == 2e-3
    assert summary["flush_final_loss"] == pytest.approx(5.25)
    rows = {row["schedule"]: row for row in summary["table"]}
    assert set(rows) == {"flush", "gpipe", "2bw"}
    gap = rows["2bw"]["gap"]  # 5.05 / 5.0 and 6.05 / 5.5, paired by seed
    assert gap["mean"] == pytest.approx((0.01 + 0.1) / 2) and gap["min"] == pytest.approx(0.01)
    assert rows["2bw"]["best_lr"] == 2e-3  # the diverged run at 1e-3 loses
    assert rows["2bw"]["samples_to_flush_final"] is None  # its mean 5.55 never reaches 5.25
    assert rows["2bw"]["seeds_reaching_flush_final"] == 0  # neither seed reaches its Flush's
    assert rows["flush"]["seeds_reaching_flush_final"] == 2
    assert rows["flush"]["samples_to_flush_final"] == pytest.approx(16)
    assert rows["gpipe"]["seconds_to_flush_final"] == pytest.approx(32)
    assert rows["2bw"]["gap_along_samples"][0] == pytest.approx((8, 7.75 / 7 - 1))
    # 2BW's 16 samples take the modelled time of Flush's 8: Flush's mean loss there is 7
    assert rows["2bw"]["flush_loss_at_end_time"] == pytest.approx(7.0)
    assert rows["gpipe"]["flush_loss_at_end_time"] == pytest.approx(5.25)  # it ends with Flush


def test_missing_data_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        convergence.main(["--quick", "--data-dir", str(tmp_path / "none")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("t1,t2", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["pipemare", "pipemare-t1", "pipemare-t2", "pipemare-t1-t2"])
def test_the_simulated_pipemare_rule_equals_the_runtime_reference_at_one_microbatch(t1, t2):
    """At m = 1 (the paper's setting; the runtime's forward versions depend on m, the
    simulation's do not) the simulated PipeMare, with T1 and T2, equals
    tests/pipeline/pipemare_reference.py, which the multi-process runtime is checked against."""
    decay = 0.9 if t2 else 0.0
    config = tiny_config(optimizer="adam", lr=0.01, clip=0.5, global_batch=2,
                         untie_embeddings_and_output_weights=True)
    config.optimizer.weight_decay = 0.0
    feed = gpt_feed(config, ParallelLayout(1, 1, 1))
    rule = next(r for r in convergence.RULES if r.name == "pipemare")
    rule = dataclasses.replace(rule, lr_warmup_iters=3 if t1 else 0, discrepancy_decay=decay)
    sim = convergence.Simulation(rule, 0.01, convergence.Study(), config.model, config.optimizer)
    for b in range(6):
        sim.step(b, [feed(b)["tokens"]])
    simulated = {n: m.detach() for (n, _), m in zip(sim.model.named_parameters(), sim.master)}
    expected = pipemare_reference(config, 6, feed, 1, 4, lr_warmup_iters=3 if t1 else 0,
                                  discrepancy_decay=decay)
    assert max_difference(simulated, expected, config.model.vocab_size) < 1e-5
    assert max_difference(simulated, per_stage_delay_reference(
        config, 6, feed, 1, "pipedream", 4, clip="stage"), config.model.vocab_size) > 1e-4


def test_an_equal_time_run_makes_the_updates_its_schedule_fits_in_flush_time():
    rule = next(r for r in convergence.RULES if r.equal_time)
    study = convergence.Study(iterations=600, warmup=60)
    as_run = convergence.as_run_by(rule, study, {"flush": 2.56, "gpipe": 2.56, "2bw": 2.229})
    assert (as_run.iterations, as_run.warmup) == (689, 69)  # 600 * 2.56 / 2.229, warm-up alike
    assert convergence.as_run_by(convergence.RULES[0], study, {"flush": 1.0}) is study


def test_a_saved_study_keeps_the_runs_of_unchanged_rules_only():
    flush, two = convergence.Rule("flush", "flush"), convergence.Rule("2bw", "2bw", "uniform")
    setup = {"iterations": 600, "rules": [flush.__dict__, two.__dict__]}
    old_flush = {k: v for k, v in flush.__dict__.items() if k != "equal_time"}  # saved before
    saved = {"setup": {"iterations": 600, "rules": [old_flush, {**two.__dict__, "dc_lambda": 1.0}]},
             "runs": [_run("flush", 1e-3, 1234, [9, 7, 6]), _run("2bw", 1e-3, 1234, [9, 7, 6])],
             "stage_costs": {"forward_s": [1.0]}, "summary": {}}
    kept = convergence.kept_from(saved, setup)
    assert [r["rule"] for r in kept["runs"]] == ["flush"]  # 2bw's rule has changed since
    assert kept["stage_costs"] == {"forward_s": [1.0]} and "summary" not in kept
    assert kept["setup"] == setup
    assert convergence.kept_from(saved, {**setup, "iterations": 300})["runs"] == []
