"""--recompute-num-layers-per-stage and the repartitioning flags: good values fill the config, bad
ones end with one line naming the flag and exit code 2."""
import os
import subprocess
import sys

import pytest

from megatron_2bw.arguments import ConfigError, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "16", "--micro-batch-size", "2", "--train-iters", "2", "--mock-data", "--vocab-size", "64",
        "--pipeline-model-parallel-size", "2"]


def test_flags_fill_the_config():
    config, _ = parse_config([*TINY, "--recompute-num-layers-per-stage", "2,0",
                              "--pipeline-repartition-interval", "10",
                              "--pipeline-repartition-min-gain", "0.1"])
    assert config.recompute.num_layers_per_stage == [2, 0]
    assert config.parallel.repartition_interval == 10
    assert config.parallel.repartition_min_gain == 0.1
    default, _ = parse_config(TINY)
    assert default.parallel.repartition_min_gain == 0.05
    assert default.parallel.repartition_interval is None


@pytest.mark.parametrize("extra,expected", [
    (["--recompute-num-layers-per-stage", "1,1,1"],
     "--recompute-num-layers-per-stage 1,1,1 gives 3 stages, --pipeline-model-parallel-size is 2"),
    (["--recompute-num-layers-per-stage", "3,0"],
     "--recompute-num-layers-per-stage 3,0: stage 0 holds 2 layers"),
    (["--recompute-num-layers-per-stage", "3,0", "--pipeline-layer-split", "3,1"], None),
    (["--recompute-num-layers-per-stage", "1,x"],
     "--recompute-num-layers-per-stage expects comma-separated integers"),
    (["--recompute-num-layers-per-stage", "1,0", "--recompute-activations"],
     "--recompute-num-layers-per-stage recomputes whole layers"),
    (["--pipeline-layer-split", "3,2"],
     "--pipeline-layer-split 3,2 must give 2 positive layer counts summing to --num-layers 4"),
    (["--pipeline-repartition-interval", "0"],
     "--pipeline-repartition-interval must be a positive integer, got 0"),
    (["--pipeline-repartition-min-gain", "-1"], "--pipeline-repartition-min-gain must be >= 0"),
    (["--pipeline-repartition-interval", "5", "--pipeline-schedule", "pipedream",
      "--untie-embeddings-and-output-weights"],
     "--pipeline-repartition-interval with --pipeline-schedule pipedream needs --vertical-sync"),
])
def test_bad_plans_name_the_flag(extra, expected):
    if expected is None:  # a valid plan for that split
        parse_config([*TINY, *extra])
        return
    with pytest.raises(ConfigError) as error:
        parse_config([*TINY, *extra])
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_bad_plan_exits_2_with_one_line():
    extra, expected = ["--recompute-num-layers-per-stage", "3,0"], "stage 0 holds 2 layers"
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, *extra], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0] and lines[0].startswith("pretrain_gpt.py: error: "), lines[0]
