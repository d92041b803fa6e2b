"""Smoke test of the throughput benchmark's machinery on a tiny GPT (the numbers are not checked:
only that every run trains the same model on the same data and the outputs are well formed)."""
import json
import subprocess
import sys

import pytest

from tests.benchmarks import load_benchmark
from tests.virtual_clock import VirtualClock

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "16", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--warmup-batches", "1", "--measured-batches", "2", "--repeats", "1",
        "--idle-timeout", "0", "--retries", "0",  # a busy test machine is fine for a smoke test
        "--side-by-side-seconds", "0.2"]


bench = load_benchmark("pipeline_throughput")


def test_every_run_trains_the_same_model_and_reports(tmp_path, capsys):
    json_path, png_path = tmp_path / "results.json", tmp_path / "throughput.png"
    summaries = bench.main(TINY + ["--json", str(json_path), "--plot", str(png_path)])
    record = json.loads(json_path.read_text())
    names = [run["name"] for run in record["runs"]]
    assert names == ["one_process", "gpipe", "flush", "2bw", "zb-h1", "interleaved", "torch_1f1b",
                     "torch_gpipe", "torch_interleaved_1f1b", "torch_zero_bubble", "deepspeed"]
    for run in record["runs"]:
        assert run["tokens_per_s"] > 0 and run["segment_tokens_per_s"] > 0
        assert len(run["peak_memory_bytes"]) == (1 if run["name"] == "one_process" else 2)
        assert all(b > 0 for b in run["peak_memory_bytes"])
    # identical initial weights and data: batch 0's loss is the same function value in every run,
    # ours and the peers' (the 2BW delay only changes later batches)
    losses = [s.first_loss for s in summaries]
    assert all(abs(loss - losses[0]) < 1e-4 for loss in losses), losses
    assert record["runs"][0]["speedup_vs_one_process"] == pytest.approx(1.0)
    assert sum(record["layer_split"]) == 4 and record["ideal_speedup"] > 1.0
    assert png_path.read_bytes()[:8] == PNG_SIGNATURE
    table = capsys.readouterr().out
    assert all(name in table for name in names) and "ideal speed-up" in table
    assert all(cores >= 0 for run in record["runs"] for cores in run["other_processes_cores"])
    (stages,) = record["stages_side_by_side"]  # one round
    assert len(stages["alone_s"]) == len(stages["together_s"]) == 2
    assert all(seconds > 0 for seconds in stages["alone_s"] + stages["together_s"])
    assert "stages side by side" in table and "round 1: stage 0" in table and "2bw measured" in table


def test_the_v_schedules_run_beside_torchs(tmp_path):
    """Ours (zb-v, dualpipev, v-half) and torch's ScheduleZBVZeroBubble and ScheduleDualPipeV in
    one run, on the same model, weights and data: the first batch's loss agrees."""
    json_path = tmp_path / "v.json"
    runs = "one_process,zb-v,torch_zbv,dualpipev,torch_dualpipev,v-half"
    summaries = bench.main([*TINY, "--global-batch-size", "8", "--runs", runs,
                            "--side-by-side-seconds", "0", "--json", str(json_path)])
    record = json.loads(json_path.read_text())
    assert [run["name"] for run in record["runs"]] == runs.split(",")
    for run in record["runs"][1:]:
        assert run["tokens_per_s"] > 0 and len(run["peak_memory_bytes"]) == 2
    losses = [s.first_loss for s in summaries]
    assert all(abs(loss - losses[0]) < 1e-4 for loss in losses), losses


def test_side_by_side_phase_runs_right_after_each_round_s_2bw_run(monkeypatch):
    workload, _, _ = bench.parse_workload(bench.build_parser().parse_args(TINY))
    order = []

    def run_once(name, *args, **kwargs):
        order.append(name)
        ends = {b: float(b) for b in range(workload.warmup_batches,
                                            workload.warmup_batches + workload.measured_batches)}
        return [bench.RankResult(1.0, 1, None, batch_ends=ends)] * bench.RUNS[name][0]

    def side_by_side(*args):
        order.append("side by side")
        return bench.SideBySide([1.0, 1.0], [1.0, 1.0])
    monkeypatch.setattr(bench, "run_once", run_once)
    monkeypatch.setattr(bench, "measure_side_by_side", side_by_side)
    names = ["one_process", "2bw", "flush", "gpipe"]
    _, rounds, orders = bench.benchmark(workload, names, [1, 1], repeats=3,
                                        side_by_side_seconds=1.0)
    assert len(rounds) == 3 and all(sorted(o) == sorted(names) for o in orders)
    expected = []
    for runs in orders:
        for name in runs:
            expected += [name, "side by side"] if name == "2bw" else [name]
    assert order == expected
    order.clear()  # without a 2BW run, at the end of each round
    _, _, orders = bench.benchmark(workload, ["one_process", "flush"], [1, 1], repeats=1,
                                   side_by_side_seconds=1.0)
    assert order == orders[0] + ["side by side"]


@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
def test_tokens_per_s_leaves_out_only_2bw_s_fill_and_drain(schedule):
    # the measured segment of 6 batches on 2 stages, replayed with fixed durations: the headline
    # window (between the last stage's batch ends) gives 2BW's steady period; the segment's wall
    # time also pays its one fill and drain. Flush and GPipe drain every batch: both measures agree.
    from megatron_2bw.pipeline import schedules as S
    workload, _, _ = bench.parse_workload(bench.build_parser().parse_args(
        TINY + ["--warmup-batches", "1", "--measured-batches", "6"]))
    m, first = workload.microbatches, workload.warmup_batches
    costs = {S.FORWARD: 1.0, S.BACKWARD: 2.0}
    timed = S.timeline(S.build_schedule(schedule, 2, m, workload.measured_batches, first),
                       lambda stage, a: costs.get(a.kind, 0.0))
    ends = {t.action.microbatch // m: t.end for t in timed[1]
            if t.action.kind == S.BACKWARD and t.action.microbatch % m == m - 1}
    segment_seconds = max(t.end for row in timed for t in row)
    ranks = [bench.RankResult(segment_seconds, 1, None, batch_ends=ends)] * 2
    steady = bench.steady_tokens_per_s(workload, ranks)
    segment = workload.measured_batches * workload.tokens_per_batch / segment_seconds
    period = {"2bw": 3.0 * m, "flush": 3.0 * m + 3.0, "gpipe": 3.0 * m + 3.0}[schedule]
    assert steady == pytest.approx(workload.tokens_per_batch / period)
    if schedule == "2bw":  # the fill (stage 1 waits one forward) and drain (stage 0's last backward)
        assert segment_seconds == pytest.approx(workload.measured_batches * period + 1.0 + 2.0)
        assert segment < 0.93 * steady
    else:  # a segment of drained batches is just those batches
        assert segment == pytest.approx(steady, rel=0.05)


def test_side_by_side_ideal_is_the_one_core_total_over_the_slowest_busy_stage():
    stages = bench.SideBySide(alone_s=[0.40, 0.38], together_s=[0.44, 0.39])
    assert stages.ideal_speedup_alone == pytest.approx(0.78 / 0.40)
    assert stages.ideal_speedup_together == pytest.approx(0.78 / 0.44)
    assert stages.record()["ideal_speedup_together"] == pytest.approx(0.78 / 0.44)


def test_time_shares_break_down_each_stage_of_our_runs(tmp_path, capsys):
    json_path = tmp_path / "results.json"
    bench.main(TINY + ["--runs", "one_process,2bw,torch_1f1b", "--time-shares",
                       "--json", str(json_path)])
    runs = {run["name"]: run for run in json.loads(json_path.read_text())["runs"]}
    assert "time_shares_per_stage" not in runs["torch_1f1b"]  # the peers have no such timers
    one, pipelined = runs["one_process"]["time_shares_per_stage"], \
        runs["2bw"]["time_shares_per_stage"]
    assert len(one) == 1 and len(pipelined) == 2
    for shares in one + pipelined:
        assert {"forward", "backward", "optimizer"} <= set(shares)
        # shares of the measured time (how much of it the timed actions cover depends on the
        # machine: a stage may spend most of it waiting for the other)
        assert 0 < sum(shares.values()) <= 1.0 + 1e-6
        assert shares["forward"] > 0 and shares["backward"] > 0
    assert all("p2p-wait" in shares for shares in pipelined)
    [repeat] = runs["2bw"]["time_shares_per_repeat"]  # every repeat's shares, per stage
    assert len(repeat) == 2 and repeat[1]["forward"] > 0
    assert "p2p-wait" not in one[0]  # one process has no neighbour to wait for
    out = capsys.readouterr().out
    assert "2bw         stage 1:" in out and "p2p-wait" in out


def test_other_load_is_the_machines_processor_time_less_this_processs_per_second(monkeypatch):
    clock = VirtualClock()
    counters = {"machine": 100.0, "own": 10.0}
    monkeypatch.setattr(bench, "time", clock.as_time_module())
    monkeypatch.setattr(bench, "machine_cpu_seconds", lambda: counters["machine"])
    monkeypatch.setattr(bench, "own_cpu_seconds", lambda: counters["own"])
    meter = bench.OtherLoad()
    meter.start()
    clock.advance(2.0)
    counters["machine"] += 3.0  # 1 s of it this process's own: others kept a core busy
    counters["own"] += 1.0
    assert meter.stop() == pytest.approx(1.0)
    meter.start()
    clock.advance(1.0)
    counters["own"] += 0.5  # counters read at different moments: never below 0
    assert meter.stop() == 0.0


def test_other_load_counts_a_busy_child_process():
    """The real counters: a child that spins while the meter runs shows as other load (read
    before the child is waited for: a joined child counts as this process's own)."""
    meter = bench.OtherLoad()
    meter.start()
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.5: pass\n"
                             "print('spun', flush=True)\ntime.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline() == "spun\n"  # 0.5 processor seconds, however long it took
        load = meter.stop()
    finally:
        busy.kill()
        busy.wait()
    assert load > 0, load


def test_split_is_chosen_from_measured_costs():
    costs = bench.StageCosts(embedding=0.1, layer=1.0, head=2.9)
    # an even 4|4 split leaves stage 0 with 37% of the work; 5|3 is the balanced one
    assert costs.stage_seconds([4, 4]) == pytest.approx([4.1, 6.9])
    assert costs.ideal_speedup([4, 4]) == pytest.approx(11.0 / 6.9)
    assert costs.best_split(8) == [5, 3]
    assert costs.ideal_speedup([5, 3]) == pytest.approx(11.0 / 5.9)


@pytest.mark.parametrize("argv,message", [
    (["--pipeline-layer-split", "4,4,1"], "--pipeline-layer-split expects 2 positive"),
    (["--runs", "2bw,megatron"], "--runs expects"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], "must be a multiple"),
    (["--global-batch-size", "4", "--micro-batch-size", "4"], "need at least 2"),
    (["--json", "/no/such/dir/r.json"], "does not exist"),
    (["--runs", "dualpipev", "--num-layers", "4", "--global-batch-size", "4", "--micro-batch-size",
      "2"], "DualPipeV needs at least 4 microbatches"),
    (["--retries", "-1"], "must not be negative"),
    (["--side-by-side-seconds", "-1"], "--side-by-side-seconds must not be negative"),
    (["--measured-batches", "1"], "--measured-batches must be >= 2"),
])
def test_bad_input_is_one_line_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pipeline_throughput.py: error: ") and message in err and "\n" not in err
