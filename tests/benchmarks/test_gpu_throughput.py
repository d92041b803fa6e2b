"""benchmarks/gpu_throughput.py's --tiny smoke run on the CPU: every measurement runs (ours, the
transformers peer, the layer profile), the figures follow the written-out FLOP counts (full
attention and causal), and a machine without transformers skips the peer in one line."""
import importlib.util
import json

import pytest

from tests.benchmarks import load_benchmark

gpu_throughput = load_benchmark("gpu_throughput")


def test_tiny_smoke_run_reports_throughput_mfu_memory_and_layer_figures(tmp_path):
    path = tmp_path / "gpu.json"
    report = gpu_throughput.main(["--tiny", "--no-compile", "--peak-tflops", "2.0", "--warmup",
                                  "1", "--iterations", "1", "--microbatches", "1",
                                  "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    tiny = report["models"]["tiny"]
    layers, h, s, vocab = 2, 64, 64, 512
    per_token = 6 * (12 * layers * h * h + vocab * h) + 12 * layers * s * h  # 6N + attention
    causal = 6 * (12 * layers * h * h + vocab * h) + 6 * layers * s * h
    assert tiny["flops_per_token"] == {"full": per_token, "causal": causal}
    for run in ("ours eager", "transformers GPT-2 peer"):
        result = tiny[run]
        assert result["micro_batch_size"] == 2 and result["tokens_per_s"] > 0
        assert result["tflops_per_gpu"] == pytest.approx(result["tokens_per_s"] * per_token / 1e12)
        assert result["mfu"] == pytest.approx(result["tflops_per_gpu"] / 2.0)
        assert result["tflops_per_gpu_causal"] == pytest.approx(
            result["tokens_per_s"] * causal / 1e12)
        assert result["mfu_causal"] == pytest.approx(result["tflops_per_gpu_causal"] / 2.0)
    assert set(report["flop_conventions"]) == {"full", "causal"}
    # each summary line names the convention of each figure
    assert "MFU" in report["summary"][1] and "6N + 12Lsh, full attention" in report["summary"][1]
    assert "causal 6N + 6Lsh" in report["summary"][1]
    assert tiny["ours eager"]["versus_peer"] == pytest.approx(
        tiny["ours eager"]["tokens_per_s"] / tiny["transformers GPT-2 peer"]["tokens_per_s"])
    assert tiny["ours eager"]["planner_estimate_bytes"] > 0
    assert [row["micro_batch_size"] for row in tiny["layer"]] == [1, 2]
    assert all(row["forward_s"] > 0 and row["predicted_backward_s"] > 0 for row in tiny["layer"])
    assert len(report["summary"]) == 1 + 2 + 2  # the device, two runs, two layer sizes


def test_peak_comes_from_the_device_name():
    assert gpu_throughput.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu_throughput.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_throughput.peak_tflops("NVIDIA H200") == 989.4
    assert gpu_throughput.peak_tflops("NVIDIA H200 NVL") == 835.0
    assert gpu_throughput.peak_tflops("Some Future GPU") is None


def test_compiled_run_tries_no_size_that_did_not_fit_eagerly():
    tried = [{"micro_batch_size": 4, "fits": True}, {"micro_batch_size": 8, "fits": True},
             {"micro_batch_size": 16, "fits": False}]
    eager = {"micro_batch_size": 8, "tried": tried}
    assert gpu_throughput.compiled_sizes(eager, [4, 8, 16, 32]) == [8]
    every_size_fitted = {"micro_batch_size": 8, "tried": tried[:2]}
    assert gpu_throughput.compiled_sizes(every_size_fitted, [4, 8, 16]) == [8, 16]


def test_a_failing_run_is_reported_and_the_others_still_measure(monkeypatch):
    """One GPU session runs it once: a run that fails other than out of memory (a transformers
    or compiler missing a feature) must not take the other figures with it."""
    def no_peer(*_):
        raise RuntimeError("GPT2LMHeadModel does not support sdpa\nmore detail")
    monkeypatch.setattr(gpu_throughput, "run_peer", no_peer)
    report = gpu_throughput.main(["--tiny", "--no-compile", "--no-layer-profile", "--warmup", "1",
                                  "--iterations", "1", "--microbatches", "1"])
    tiny = report["models"]["tiny"]
    assert report["failed_runs"] == ["gpt-tiny transformers GPT-2 peer"]
    assert tiny["transformers GPT-2 peer"] == {
        "error": "RuntimeError: GPT2LMHeadModel does not support sdpa"}
    assert tiny["ours eager"]["tokens_per_s"] > 0 and "versus_peer" not in tiny["ours eager"]
    assert "gpt-tiny transformers GPT-2 peer: FAILED: RuntimeError" in report["summary"][1]


def test_the_json_holds_every_run_finished_before_a_cut_off(tmp_path, monkeypatch):
    """gpu-check cuts the benchmark off at its time limit: what it measured must be on disk."""
    path = tmp_path / "gpu.json"

    def cut_off(*_):
        raise SystemExit("cut off")  # where the time limit ends the process
    monkeypatch.setattr(gpu_throughput, "layer_profile", cut_off)
    with pytest.raises(SystemExit):
        gpu_throughput.main(["--tiny", "--no-compile", "--warmup", "1", "--iterations", "1",
                             "--microbatches", "1", "--json", str(path)])
    saved = json.loads(path.read_text())["models"]["tiny"]
    assert saved["ours eager"]["tokens_per_s"] > 0
    assert saved["transformers GPT-2 peer"]["tokens_per_s"] > 0


def test_flop_counts_by_hand():
    """Tiny: L=2, h=64, s=64, V=512. N = 12*2*64^2 + 512*64 = 131072 weights; 6N = 786432;
    full attention 12*2*64*64 = 98304, causal half of it."""
    config = gpu_throughput.gpt_config((2, 64, 4), 64, 512, 1, 1, False)
    assert gpu_throughput.flops_per_token(config) == 786432 + 98304
    assert gpu_throughput.flops_per_token(config, "causal") == 786432 + 49152
    # GPT 1.3B at s = 2048: the causal count is about 7% below the full one
    big = gpu_throughput.gpt_config(gpu_throughput.MODELS["1.3B"], 2048, 50257, 1, 1, False)
    ratio = gpu_throughput.flops_per_token(big, "causal") / gpu_throughput.flops_per_token(big)
    assert ratio == pytest.approx(0.933, abs=0.002)


def test_without_transformers_the_peer_is_skipped_in_one_line(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    report = gpu_throughput.main(["--tiny", "--no-compile", "--no-layer-profile", "--warmup", "1",
                                  "--iterations", "1", "--microbatches", "1"])
    skipped = [line for line in capsys.readouterr().out.splitlines() if "transformers" in line]
    assert skipped == ["transformers GPT-2 peer: skipped (transformers is not installed)"]
    assert report["failed_runs"] == [] and "transformers GPT-2 peer" not in report["models"]["tiny"]
    assert report["models"]["tiny"]["ours eager"]["tokens_per_s"] > 0
