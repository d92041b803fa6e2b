"""The loop as Megatron-LM runs it: validation (off with --eval-iters 0), the test split at the
end, --skip-train, and --profile's trace of whole iterations."""
import json
import re
import subprocess
import sys

import pytest
import torch

from megatron_2bw.config import LoggingConfig
from megatron_2bw.logging import IterationProfiler
from tests.distributed_helpers import run_ranks
from tests.training.runs import MODEL, ROOT, TINY, pretrain_on_rank


def test_eval_iters_0_turns_validation_off_as_in_megatron():
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *MODEL, "--mock-data", "--vocab-size",
                             "64", "--eval-iters", "0", "--eval-interval", "1", "--log-interval",
                             "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"iteration\s+2/\s*2 \|", result.stdout), result.stdout
    assert "validation" not in result.stdout


def test_the_test_set_is_evaluated_at_the_end_and_skip_train_evaluates_a_checkpoint(tmp_path):
    """As Megatron-LM: after the last iteration the test split is evaluated too; --skip-train
    --load evaluates the saved weights on the same validation and test batches, training none."""
    def run(*extra):
        result = subprocess.run([sys.executable, "pretrain_gpt.py", *MODEL, "--mock-data",
                                 "--vocab-size", "64", "--eval-iters", "1", "--eval-interval",
                                 "1000", *extra], cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        found = dict(re.findall(r"^ (validation|test) at iteration 2 \| lm loss: (\S+)",
                                result.stdout, re.M))
        return result.stdout, found
    trained, at_end = run("--save", str(tmp_path))
    assert set(at_end) == {"validation", "test"} and at_end["validation"] != at_end["test"]
    assert re.search(r"iteration\s+2/\s*2 \|", trained)
    evaluated, skipped = run("--load", str(tmp_path), "--skip-train")
    # another process may round the same weights' loss differently in the last digits (once in
    # the full suite: 4.144422 against 4.144412); one more iteration moves it by 5e-4 here
    assert set(skipped) == set(at_end), evaluated
    assert {k: float(v) for k, v in skipped.items()} == \
        pytest.approx({k: float(v) for k, v in at_end.items()}, rel=1e-5), evaluated
    assert "skipping training (--skip-train)" in evaluated
    assert not re.search(r"^ iteration ", evaluated, re.M)


def test_profiler_traces_whole_iterations_on_the_requested_rank_only(tmp_path, capfd):
    """2BW over two stages, 2 microbatches a batch; rank 1 (the last stage) profiles iterations
    [2, 4): all of their steps and transfers, and no other iteration's (no evaluation falls
    inside the window: it would be in the trace too)."""
    tensorboard = tmp_path / "tb"
    run_ranks(2, pretrain_on_rank, [*TINY, "--eval-interval", "6",
                                    "--pipeline-model-parallel-size", "2", "--global-batch-size",
                                    "4", "--profile", "--profile-step-start", "2",
                                    "--profile-step-end", "4", "--profile-ranks", "1",
                                    "--tensorboard-dir", str(tensorboard)])
    trace = tensorboard / "profile_rank1_iter2-4.pt.trace.json"
    assert sorted(p.name for p in tensorboard.glob("profile_*")) == [trace.name]
    assert f"[rank 1] profile of iterations [2, 4) (the log's 3 to 4) written to {trace}" in \
        capfd.readouterr().out
    names = [event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]]
    assert sum(name.startswith("Optimizer.step#") for name in names) == 2
    assert names.count("c10d::recv_") == 4  # each microbatch's activations
    assert names.count("c10d::send") == 4  # and its input's gradient


def test_a_run_that_ends_inside_the_window_writes_its_trace_beside_the_log_file(tmp_path):
    config = LoggingConfig(profile=True, profile_step_start=2, profile_step_end=6,
                           log_file=str(tmp_path / "logs" / "log.jsonl"))
    assert not IterationProfiler(config, 1, "cpu").enabled  # --profile-ranks: only rank 0
    profiler = IterationProfiler(config, 0, "cpu")
    profiler.begin_segment(1)  # before the window
    profiler.end_segment(2)
    profiler.begin_segment(2)
    torch.ones(3).sum()
    profiler.end_segment(3)  # still inside
    assert not (tmp_path / "logs").exists()
    profiler.finish(3)
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["profile_rank0_iter2-3.pt.trace.json"]
