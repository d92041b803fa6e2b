import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import plan  # noqa: E402

TINY = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
        "--hidden-dropout", "0.1", "--seq-length", "64", "--vocab-size", "1000",
        "--global-batch-size", "32"]


def test_ranked_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    plans = plan.main(TINY + ["--fp16", "--world-size", "16", "--hardware", "p3.16xlarge",
                              "--top", "3", "--json", str(out_json), "--plot", str(out_png)])
    table = capsys.readouterr().out
    assert "16 x p3.16xlarge" in table and "bottleneck" in table
    rows = json.loads(out_json.read_text())["configs"]
    assert len(rows) == len(plans)
    assert {row["schedule"] for row in rows} == {"2bw", "flush", "gpipe", "zb-h1", "interleaved"}
    assert rows[0]["fits"] and rows[0] == plans[0].to_json()
    fitting = [r["throughput_samples_per_s"] for r in rows if r["fits"] and r["simulated"]]
    assert fitting == sorted(fitting, reverse=True)
    assert all(r["tensor_parallel"] * r["pipeline_parallel"] * r["data_parallel"] == 16
               for r in rows)
    assert out_png.stat().st_size > 10_000 and out_png.read_bytes()[:4] == b"\x89PNG"


def test_typed_parallel_flags_pin_the_search(capsys):
    plans = plan.main(TINY + ["--world-size", "8", "--hardware", "dgx-a100",
                              "--tensor-model-parallel-size", "2", "--pipeline-schedule", "flush",
                              "--recompute-activations"])
    assert {(p.candidate.tensor_parallel, p.candidate.schedule, p.candidate.recompute)
            for p in plans} == {(2, "flush", "selective")}


PINNED = ["--world-size", "8", "--hardware", "dgx-a100", "--tensor-model-parallel-size", "2",
          "--pipeline-model-parallel-size", "2", "--micro-batch-size", "4",
          "--pipeline-schedule", "2bw"]


def titles(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("gpt L")]


def test_sequence_parallel_reaches_the_plan(capsys):
    """--sequence-parallel is a model flag: the plans follow it (less activation memory on each
    stage of the same configuration) without searching it."""
    plain = plan.main(TINY + PINNED)
    split = plan.main(TINY + PINNED + ["--sequence-parallel"])
    assert [p.candidate for p in split] == [p.candidate for p in plain]
    for a, b in zip(plain, split):
        assert all(s.activations < p.activations for p, s in zip(a.stage_memory, b.stage_memory))
    plan.main(TINY + PINNED + ["--sequence-parallel", "--swiglu"])
    named = titles(capsys)
    assert "sequence" not in named[0] and " sequence-parallel, batch" in named[1]
    assert " swiglu sequence-parallel, batch" in named[2]  # the layout's switches are named


def test_the_fp32_softmax_keeps_the_fused_attentions_plan_by_default():
    """scaled_dot_product_attention computes the softmax in fp32: the flag changes no estimate."""
    plain = plan.main(TINY + PINNED + ["--bf16"])
    flagged = plan.main(TINY + PINNED + ["--bf16", "--attention-softmax-in-fp32"])
    assert [p.candidate for p in flagged] == [p.candidate for p in plain]
    assert [p.stage_memory for p in flagged] == [p.stage_memory for p in plain]


def test_the_attention_switches_reach_the_plan(capsys, reduced_precision_math_attention):
    """bf16: the fp32 softmax's unfused attention stashes its scores in fp32 (more activation
    memory on each stage of the same configuration unless recomputation drops them);
    --qk-layernorm, --apply-layernorm-1p and the fp32 softmax are named in the title."""
    plain = plan.main(TINY + PINNED + ["--bf16"])
    unfused = plan.main(TINY + PINNED + ["--bf16", "--attention-softmax-in-fp32"])
    assert [p.candidate for p in unfused] == [p.candidate for p in plain]
    for a, b in zip(plain, unfused):
        for p, u in zip(a.stage_memory, b.stage_memory):
            assert u.activations > p.activations if a.candidate.recompute is None \
                else u.activations == p.activations
    plan.main(TINY + PINNED + ["--bf16", "--qk-layernorm", "--apply-layernorm-1p",
                               "--apply-query-key-layer-scaling"])
    named = titles(capsys)
    assert " fp32softmax, batch" in named[1]
    assert " qknorm norm1p fp32softmax, batch" in named[2]


def run_tool(*args, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *args],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_errors_are_one_line_and_exit_2():
    result = run_tool(*TINY, "--world-size", "8", "--hardware", "nowhere")
    assert result.returncode == 2
    assert result.stderr.startswith("plan.py: error: hardware file 'nowhere' not found")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--world-size", "8"], "--hardware"),
    (["--world-size", "0", "--hardware", "dgx-a100"], "--world-size must be a positive integer"),
    (["--world-size", "8", "--hardware", "dgx-a100", "--top", "0"], "--top"),
    (["--world-size", "8", "--hardware", "dgx-a100", "--json", "/no/such/dir/x.json"],
     "--json /no/such/dir/x.json: the directory does not exist"),
    (["--world-size", "8", "--hardware", "dgx-a100", "--plot", "plan.txt"],
     r"--plot plan.txt: expected an image file name ending in one of .*\.png"),
    (["--world-size", "8", "--hardware", "p3.16xlarge", "--bf16"], "no peak_flops for bfloat16"),
])
def test_bad_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        plan.main(TINY + args)


def test_missing_vocabulary_or_batch_is_named():
    without_vocab = [a for a in TINY if a not in ("--vocab-size", "1000")]
    with pytest.raises(ValueError, match="--vocab-size"):
        plan.main(without_vocab + ["--world-size", "8", "--hardware", "dgx-a100"])
    without_batch = [a for a in TINY if a not in ("--global-batch-size", "32")]
    with pytest.raises(ValueError, match="--global-batch-size"):
        plan.main(without_batch + ["--world-size", "8", "--hardware", "dgx-a100"])


def test_local_hardware_measures_this_machine(tmp_path):
    result = run_tool(*TINY, "--world-size", "2", "--hardware", "local", "--profile-cache",
                      str(tmp_path), "--json", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.glob("*__gpt-h128-a4-f512-s64-v1024-dropout0.1-0.1__float32.json"))
    rows = json.loads((tmp_path / "plan.json").read_text())["configs"]
    assert rows[0]["fits"] and rows[0]["tensor_parallel"] == 1  # one device per node here
    assert "2 ranks are planned on 2 such machines" in result.stderr


def test_the_table_ends_with_a_summary_line_also_when_nothing_fits(capsys):
    plan.main(TINY + ["--world-size", "8", "--hardware", "dgx-a100"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("best: t=") and " samples/s predicted, peak " in last
    assert last.endswith(" of 74.10 GiB per device")
    plan.main(["--num-layers", "48", "--hidden-size", "8192", "--num-attention-heads", "64",
               "--seq-length", "2048", "--vocab-size", "128", "--global-batch-size", "8",
               "--world-size", "1", "--hardware", "dgx-a100"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("no configuration fits in 74.10 GiB per device: the smallest (t=1 p=1 "
                           "d=1 "), last
    assert last.endswith(" GiB; plan more devices, a smaller model or --use-distributed-optimizer")
