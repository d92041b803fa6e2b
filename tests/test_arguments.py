"""Bad input ends with one clear line naming the flag and what was expected, exit code 2, no
traceback and no hang; good flags map onto the config dataclasses."""
import os
import subprocess
import sys

import pytest

from megatron_2bw.arguments import ConfigError, parse_config, validate_for_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "16", "--micro-batch-size", "2", "--train-iters", "2", "--mock-data", "--vocab-size", "64"]


@pytest.mark.parametrize("extra,expected", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 must divide --num-attention-heads 4"),
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--global-batch-size", "5"], "--global-batch-size 5 must be divisible by --micro-batch-size 2"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--pipeline-layer-split", "1,x"], "--pipeline-layer-split expects comma-separated integers"),
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
])
def test_bad_flags_give_one_line(extra, expected):
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, *extra], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0] and lines[0].startswith("pretrain_gpt.py: error: ")
    assert "Traceback" not in result.stderr


def test_flags_fill_the_config():
    config, _ = parse_config([*TINY, "--tensor-model-parallel-size", "2", "--pipeline-schedule",
                              "flush", "--bf16", "--recompute-activations", "--clip-grad", "0"])
    assert config.parallel.tensor_parallel == 2 and config.parallel.pipeline_schedule == "flush"
    assert config.precision.bf16 and config.recompute.granularity == "selective"
    assert config.model.ffn_hidden_size == 128 and config.optimizer.clip_grad == 0.0


def test_default_schedule_is_2bw_with_a_pipeline():
    config, _ = parse_config([*TINY, "--pipeline-model-parallel-size", "2"])
    assert config.parallel.pipeline_schedule == "2bw"
    config.training.global_batch_size = 2
    with pytest.raises(ConfigError, match="needs at least as many microbatches per batch as stages"):
        validate_for_world(config, 2)


def test_missing_data_flag_is_named():
    with pytest.raises(ConfigError, match="--data-path"):
        parse_config([a for a in TINY if a not in ("--mock-data",)])
