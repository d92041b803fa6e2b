"""pretrain_gpt.py under torchrun: tensor parallelism (t=2 x d=2), 2BW with t=2 x p=2 (GPT-2's
layout, and Llama's with sequence parallelism) and with p=2 x cp=2 (context parallelism) train a
tiny GPT on --mock-data and the loss falls."""
import os
import re
import subprocess
import sys

import pytest

from tests.distributed_helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
        "32", "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "40",
        "--lr", "3e-3", "--mock-data", "--vocab-size", "128", "--log-interval", "10",
        "--eval-interval", "40", "--eval-iters", "1"]


def losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^ iteration .*?\| lm loss: ([0-9.E+-]+)", output, re.M)]


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
     "--pipeline-schedule", "2bw", "--bind-cores-to-rank"],
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",  # Llama's layout
     "--normalization", "RMSNorm", "--disable-bias-linear", "--swiglu", "--position-embedding-type",
     "rope", "--group-query-attention", "--num-query-groups", "2",
     "--untie-embeddings-and-output-weights", "--sequence-parallel",
     "--qk-layernorm", "--apply-layernorm-1p",  # and Qwen3's, in bf16 with an fp32 softmax
     "--bf16", "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling"],
    ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",  # Llama's, with rope
     "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"],
], ids=["t2d2", "t2p2-2bw", "t2p2-2bw-qwen3-bf16-sequence-parallel", "p2-cp2-2bw-llama"])
def test_loss_falls(layout):
    result = subprocess.run([TORCHRUN, "--nproc-per-node", "4", "--master-port", str(free_port()),
                             "pretrain_gpt.py", *TINY, *layout], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = losses(result.stdout)
    assert len(found) == 4, result.stdout
    assert found[-1] < found[0] - 0.5, found
    assert "validation at iteration 40" in result.stdout


def test_logged_time_per_iteration_holds_across_2bw_drains():
    """2BW defers each step until its version is needed, so a drain (here before every validation)
    runs the last steps back to back; the log still charges every iteration its batch's time.
    The arithmetic is tested on an injected clock (tests/training/test_progress.py); here the
    figures of a real job, whose sizes depend on the machine's speed, are checked for presence
    only."""
    args = [*TINY, "--hidden-size", "128", "--train-iters", "9", "--eval-interval", "3",
            "--log-interval", "1", "--pipeline-model-parallel-size", "2",
            "--pipeline-schedule", "2bw"]
    result = subprocess.run([TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()),
                             "pretrain_gpt.py", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                          result.stdout)]
    assert len(times) == 9, result.stdout
    assert all(t > 0 for t in times), times
