"""benchmarks/gpu_throughput.py's --tiny smoke run on the CPU: every measurement runs (ours, the
transformers peer, the layer profile) and the figures follow the written-out FLOP count."""
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
    for run in ("ours eager", "transformers GPT-2 peer"):
        result = tiny[run]
        assert result["micro_batch_size"] == 2 and result["tokens_per_s"] > 0
        assert result["tflops_per_gpu"] == pytest.approx(result["tokens_per_s"] * per_token / 1e12)
        assert result["mfu"] == pytest.approx(result["tflops_per_gpu"] / 2.0)
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
