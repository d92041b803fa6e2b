"""benchmarks/convergence.py: its simulated 2BW rules (none, predict, dc, ef, nesterov), PipeDream's
and PipeMare's equal the references that the multi-process runs are checked against
(tests/pipeline/compensation_reference.py, reference.py, pipemare_reference.py), its PipeMare
forward versions are the runtime's rule, every rule's best grid point is chosen by the mean over
seeds, and its quick mode writes the result, the table and the picture."""
import dataclasses
import json

import numpy as np
import pytest

from megatron_2bw.distributed.layout import ParallelLayout
from tests.benchmarks import load_benchmark, write_token_corpus
from tests.pipeline.compensation_reference import compensated_reference
from tests.pipeline.harness import gpt_feed, max_difference, tiny_config
from tests.pipeline.pipemare_reference import pipemare_reference
from tests.pipeline.reference import per_stage_delay_reference

convergence = load_benchmark("convergence")


def untied_config(**overrides):
    """Adam, clipping, no weight decay (the references put every parameter in one group), an
    untied output layer (every parameter on one stage); and its one-process feed."""
    config = tiny_config(optimizer="adam", lr=0.01, clip=0.5,
                         untie_embeddings_and_output_weights=True, **overrides)
    config.optimizer.weight_decay = 0.0
    return config, gpt_feed(config, ParallelLayout(1, 1, 1))


def simulate(rule, config, feed, batches: int, microbatches: int) -> dict:
    """The simulation's master weights by name after `batches` updates of `microbatches`."""
    sim = convergence.Simulation(rule, 0.01, convergence.Study(), config.model, config.optimizer)
    for b in range(batches):
        sim.step(b, [feed(b * microbatches + j)["tokens"] for j in range(microbatches)])
    return {n: m.detach() for (n, _), m in zip(sim.model.named_parameters(), sim.master)}


# dc's lambda large enough to move the weights; ef and nesterov at their defaults
COEFFICIENT = {"none": None, "predict": None, "dc": 5000.0, "ef": 1.0, "nesterov": 0.5}


@pytest.mark.parametrize("mode", ["none", "predict", "dc", "ef", "nesterov"])
def test_the_simulated_2bw_rules_equal_the_reference(mode):
    config = tiny_config(optimizer="adam", lr=0.01, clip=0.5)
    config.optimizer.weight_decay = 0.0  # the reference puts every parameter in one group
    feed = gpt_feed(config, ParallelLayout(1, 1, 1))
    rule = convergence.Rule("2bw", "2bw", delay="uniform", compensation=mode,
                            coefficient=5000.0 if mode == "dc" else None)
    simulated = simulate(rule, config, feed, 5, 4)
    expected = compensated_reference(config, 5, feed, 4, mode, coefficient=COEFFICIENT[mode])
    assert max_difference(simulated, expected, config.model.vocab_size) < 1e-5
    if mode != "none":
        assert max_difference(expected, compensated_reference(config, 5, feed, 4, "none"),
                              config.model.vocab_size) > 1e-4


def test_the_simulated_pipedream_rule_equals_the_per_stage_delay_reference():
    config, feed = untied_config()
    rule = next(r for r in convergence.RULES if r.name == "pipedream")
    simulated = simulate(rule, config, feed, 6, 4)
    expected = per_stage_delay_reference(config, 6, feed, 4, "pipedream", 4, clip="stage")
    assert max_difference(simulated, expected, config.model.vocab_size) < 1e-5
    assert max_difference(simulated, per_stage_delay_reference(config, 6, feed, 4, "2bw", 4),
                          config.model.vocab_size) > 1e-4


def test_quick_mode_writes_the_result_and_the_picture(tmp_path, capsys):
    """Every rule runs through the whole path (simulation, timing replay, summary, plot) on a
    small generated corpus standing in for the prepared Shakespeare data: every rule at every
    point of the 2 x 2 grid (rate x warm-up) on both seeds."""
    write_token_corpus(tmp_path)
    out = tmp_path / "convergence.json"
    convergence.main(["--quick", "--data-dir", str(tmp_path), "--json", str(out),
                      "--plot", str(tmp_path / "convergence.png")])
    result = json.loads(out.read_text())
    runs = {(r["rule"], r["optimizer"], r["lr"], r["warmup"], r["seed"]) for r in result["runs"]}
    names = set(convergence.STUDIED)
    assert runs == {(n, "adam", lr, w, s) for n in names for lr in (1e-3, 2e-3)
                    for w in (0.25, 0.5) for s in (1234, 1235)}
    seconds = result["time_per_sample_s"]
    for run in result["runs"]:
        assert run["iterations"] == 4
        assert [s for s, _ in run["curve"]] == [0, 8, 16]  # before, every 2 updates
    # the flushed schedules fill and drain every batch, 2BW once per segment
    assert min(seconds["gpipe"], seconds["flush"]) > seconds["2bw"] > 0
    assert (tmp_path / "convergence.png").stat().st_size > 0
    rows = {(row["schedule"], row["optimizer"]) for row in result["summary"]["table"]}
    assert rows == {(n, "adam") for n in names | {"gpipe"}}
    assert result["summary"]["targets"]["2bw_best"]["rule"].startswith("2bw")
    assert "| 2bw-ef | adam |" in capsys.readouterr().out


def _run(rule, lr, warmup, seed, finals, samples=(0, 8, 16)):
    return {"rule": rule, "optimizer": "adam", "lr": lr, "warmup": warmup, "seed": seed,
            "curve": [[s, loss] for s, loss in zip(samples, finals)]}


def test_every_rule_takes_its_best_grid_point_by_the_mean_over_seeds():
    """Flush and 2BW on a 2 x 2 grid, 2 seeds: each rule's best point is the lowest mean final
    loss (a diverged seed makes its point lose), gaps are paired seed by seed against Flush's
    best point, and the targets compare the two best means."""
    rules = [convergence.Rule("flush", "flush"), convergence.Rule("2bw", "2bw", delay="uniform")]
    study = convergence.Study(lrs=(1e-3, 2e-3), warmups=(0.1, 0.2), seeds=2, rules=rules)
    runs = []
    finals = {("flush", 1e-3, 0.1): (6.0, 6.0), ("flush", 1e-3, 0.2): (5.0, 5.5),
              ("flush", 2e-3, 0.1): (4.0, 7.5), ("flush", 2e-3, 0.2): (5.2, 5.4),
              ("2bw", 1e-3, 0.1): (5.05, 6.05), ("2bw", 1e-3, 0.2): (5.0, float("nan")),
              ("2bw", 2e-3, 0.1): (6.0, 6.0), ("2bw", 2e-3, 0.2): (5.9, 5.9)}
    for (rule, lr, warmup), pair in finals.items():
        for seed, final in zip((1234, 1235), pair):
            runs.append(_run(rule, lr, warmup, seed, [9, 7, final]))
    summary = convergence.summarize(runs, {"flush": 2.0, "gpipe": 2.0, "2bw": 1.0}, study)
    rows = {row["schedule"]: row for row in summary["table"]}
    assert set(rows) == {"flush", "gpipe", "2bw"}
    # Flush: means 6.0, 5.25, 5.75, 5.3 -> (1e-3, 0.2), not the single best seed's point
    assert (rows["flush"]["best_lr"], rows["flush"]["best_warmup"]) == (1e-3, 0.2)
    # 2BW: (1e-3, 0.2) has a diverged seed: it loses; (1e-3, 0.1) mean 5.55 wins
    assert (rows["2bw"]["best_lr"], rows["2bw"]["best_warmup"]) == (1e-3, 0.1)
    assert rows["2bw"]["final_loss"]["mean"] == pytest.approx(5.55)
    gap = rows["2bw"]["gap"]  # 5.05 / 5.0 and 6.05 / 5.5, paired by seed
    assert gap["mean"] == pytest.approx((0.01 + 0.1) / 2) and gap["min"] == pytest.approx(0.01)
    assert rows["2bw"]["perplexity"]["mean"] == pytest.approx((np.exp(5.05) + np.exp(6.05)) / 2)
    assert rows["2bw"]["samples_to_flush_final"] is None  # its mean 5.55 never reaches 5.25
    assert rows["flush"]["samples_to_flush_final"] == pytest.approx(16)
    assert rows["gpipe"]["seconds_to_flush_final"] == pytest.approx(32)
    # 2BW's 16 samples take the modelled time of Flush's 8: Flush's mean loss there is 7
    assert rows["2bw"]["flush_loss_at_end_time"] == pytest.approx(7.0)
    targets = summary["targets"]
    assert targets["loss_gap"] == pytest.approx(5.55 / 5.25 - 1)
    assert targets["perplexity_gap"] == pytest.approx(np.exp(0.3) - 1)
    assert not targets["within_half_percent"]


def test_missing_data_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        convergence.main(["--quick", "--data-dir", str(tmp_path / "none")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("t1,t2", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["pipemare", "pipemare-t1", "pipemare-t2", "pipemare-t1-t2"])
def test_the_simulated_pipemare_rule_equals_the_runtime_reference_at_one_microbatch(t1, t2):
    """At m = 1 (the paper's setting) the simulated PipeMare, with T1 and T2, equals
    tests/pipeline/pipemare_reference.py, which the multi-process runtime is checked against."""
    decay = 0.9 if t2 else 0.0
    config, feed = untied_config(global_batch=2)
    rule = next(r for r in convergence.RULES if r.name == "pipemare")
    rule = dataclasses.replace(rule, lr_warmup_iters=3 if t1 else 0, discrepancy_decay=decay)
    simulated = simulate(rule, config, feed, 6, 1)
    expected = pipemare_reference(config, 6, feed, 1, 4, lr_warmup_iters=3 if t1 else 0,
                                  discrepancy_decay=decay)
    assert max_difference(simulated, expected, config.model.vocab_size) < 1e-5
    assert max_difference(simulated, per_stage_delay_reference(
        config, 6, feed, 1, "pipedream", 4, clip="stage"), config.model.vocab_size) > 1e-4


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_the_simulated_pipemare_forward_versions_are_the_runtime_rule(m):
    """The version each microbatch's forward reads in the simulation equals the runtime's rule
    (megatron_2bw/pipeline/pipemare.py, which tests/pipeline/test_pipemare.py checks against the
    executor's actions) at every m, and so does its delay; at m > 1 that is not p - 1 - s."""
    from megatron_2bw.pipeline import pipemare
    stages = convergence.STAGES
    for b in range(6):
        for j in range(m):
            for s in range(stages):
                k = b * m + j
                assert convergence.pipemare_forward_version(b, j, s, m) == \
                    pipemare.forward_version(k, m, s, stages)
    if m > 1:  # stage 0, microbatch 1 of batch 2: delay 1 (ceil((3 - 1) / m)), not 3
        assert 2 - convergence.pipemare_forward_version(2, 1, 0, m) == \
            pipemare.microbatch_delay(2 * m + 1, m, 0, stages) < stages - 1


def test_the_simulated_pipemare_rule_equals_the_runtime_reference_at_four_microbatches():
    """At m = 4 the simulation reads each microbatch's own forward version: it equals
    tests/pipeline/pipemare_reference.py at m = 4 (the reference the multi-process runtime is
    checked against)."""
    config, feed = untied_config()
    rule = next(r for r in convergence.RULES if r.name == "pipemare")
    simulated = simulate(rule, config, feed, 5, 4)
    expected = pipemare_reference(config, 5, feed, 4, 4)
    assert max_difference(simulated, expected, config.model.vocab_size) < 1e-5


def test_a_saved_study_keeps_the_runs_of_unchanged_rules_only():
    flush, two = convergence.Rule("flush", "flush"), convergence.Rule("2bw", "2bw", "uniform")
    setup = {"iterations": 600, "rules": [flush.__dict__, two.__dict__]}
    old_flush = {k: v for k, v in flush.__dict__.items() if k != "coefficient"}  # saved before
    saved = {"setup": {"iterations": 600,
                       "rules": [old_flush, {**two.__dict__, "coefficient": 1.0}]},
             "runs": [_run("flush", 1e-3, 0.1, 1234, [9, 7, 6]),
                      _run("2bw", 1e-3, 0.1, 1234, [9, 7, 6])],
             "stage_costs": {"forward_s": [1.0]}, "summary": {}}
    kept = convergence.kept_from(saved, setup)
    assert [r["rule"] for r in kept["runs"]] == ["flush"]  # 2bw's rule has changed since
    assert kept["stage_costs"] == {"forward_s": [1.0]} and "summary" not in kept
    assert kept["setup"] == setup
    assert convergence.kept_from(saved, {**setup, "iterations": 300})["runs"] == []
