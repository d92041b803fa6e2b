"""The V schedules (zb-v, dualpipev, v-half) with real ranks: two model chunks per rank in a V,
chunk 1's transfers running up the ranks, the turn on the last rank a local hand-off, the
embedding and the output layer on rank 0 (the tie is local). Each equals one process to 1e-5,
with recomputation, ZeRO-1 and tied embeddings."""
import functools
import os
import re
import subprocess
import sys

import pytest

from megatron_2bw.arguments import ConfigError, parse_config
from megatron_2bw.checkpoint.reshard import read_full_state, write_full_state
from megatron_2bw.config import RecomputeConfig
from megatron_2bw.config_checks import validate_for_world
from tests.data.helpers import load_tool
from tests.distributed_helpers import run_ranks
from tests.pipeline.checkpoint_helpers import load_and_train, train_and_save, true_vocabulary
from tests.pipeline.harness import (evaluate_on_ranks, full_weights, max_difference, tiny_config,
                                    train_on_ranks)
from tests.pipeline.precision_harness import train_stage

VOCAB = 101
convert_checkpoint = load_tool("convert_checkpoint")


def config(schedule="flush", layers=4, p=1, t=1, global_batch=8, chunks=None):
    c = tiny_config(optimizer="adam", lr=0.01, clip=0.5, schedule=schedule, layers=layers,
                    p=p, t=t, global_batch=global_batch)
    c.parallel.virtual_pipeline_parallel = chunks
    return c


@functools.lru_cache(maxsize=None)
def one_process(layers: int, global_batch: int):
    return full_weights(run_ranks(1, train_on_ranks, config(layers=layers,
                                                            global_batch=global_batch), 3))


def _matches(c, world, train=train_on_ranks):
    results = run_ranks(world, train, c, 3)
    reference = one_process(c.model.num_layers, c.training.global_batch_size)
    assert max_difference(full_weights(results), reference, VOCAB) < 1e-5


# (t, p, world, global batch): p2, p4, t2 x p2, p2 x d2; dualpipev needs m >= 2p
LAYOUTS = [(1, 2, 2, 8), (1, 4, 4, 16), (2, 2, 4, 8), (1, 2, 4, 16)]


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev", "v-half"])
@pytest.mark.parametrize("t,p,world,global_batch", LAYOUTS)
def test_v_schedules_match_one_process(schedule, t, p, world, global_batch):
    _matches(config(schedule, layers=2 * p, p=p, t=t, global_batch=global_batch), world)


@pytest.mark.parametrize("schedule,p", [("zb-v", 2), ("v-half", 4)])
def test_v_evaluation_matches_one_process(schedule, p):
    """Forward-only down chunk 0 and back up chunk 1: rank 0 sums the loss."""
    single = run_ranks(1, evaluate_on_ranks, config(layers=2 * p))[0]
    v = run_ranks(p, evaluate_on_ranks, config(schedule, layers=2 * p, p=p))[0]
    assert v["weight"] == single["weight"] == 4.0
    assert v["sums"]["lm loss"] == pytest.approx(single["sums"]["lm loss"], abs=1e-5)


def test_an_untied_output_layer_on_rank_0_matches_one_process():
    untied = config("zb-v", p=2)
    untied.model.untie_embeddings_and_output_weights = True
    reference = config()
    reference.model.untie_embeddings_and_output_weights = True
    expected = full_weights(run_ranks(1, train_on_ranks, reference, 3))
    results = run_ranks(2, train_on_ranks, untied, 3)
    assert "output_layer" in expected
    assert max_difference(full_weights(results), expected, VOCAB) < 1e-5


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev", "v-half"])
def test_recomputation_and_zero1_match_one_process(schedule):
    recomputed = config(schedule, p=2)
    recomputed.recompute = RecomputeConfig("full", "uniform", 1)
    _matches(recomputed, 2)
    zero1 = config(schedule, p=2, global_batch=16)
    zero1.parallel.use_distributed_optimizer = True  # p2 x d2: each replica steps half
    _matches(zero1, 4, train_stage)  # (it gathers the full master weights)


TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "16", "--micro-batch-size", "2", "--train-iters", "2", "--mock-data", "--vocab-size", "64",
        "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev", "v-half"])
def test_the_v_flags_set_two_chunks_in_a_v(schedule):
    config, _ = parse_config([*TINY, "--pipeline-schedule", schedule, "--global-batch-size", "8"])
    assert config.parallel.model_chunks == 2 and config.parallel.pipeline_shape == "v"


@pytest.mark.parametrize("extra,expected", [
    (["--pipeline-schedule", "zb-v", "--num-layers", "3"],
     "--pipeline-schedule zb-v cuts the model into 2 x --pipeline-model-parallel-size = 4 chunks"),
    (["--pipeline-schedule", "v-half", "--virtual-pipeline-model-parallel-size", "3"],
     "--pipeline-schedule v-half places exactly 2 model chunks per rank (a V)"),
    (["--pipeline-schedule", "zb-v", "--pipeline-layer-split", "1,3"],
     "--pipeline-layer-split does not apply to --pipeline-schedule zb-v"),
    (["--pipeline-schedule", "dualpipev", "--pipeline-repartition-interval", "5"],
     "--pipeline-repartition-interval does not apply to --pipeline-schedule dualpipev"),
    (["--pipeline-schedule", "v-half", "--auto-parallel"],
     "--auto-parallel does not plan --pipeline-schedule v-half"),
])
def test_bad_v_flags_are_named(extra, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_config([*TINY, *extra])


def test_too_few_microbatches_for_dualpipev_are_named():
    config, _ = parse_config([*TINY, "--pipeline-schedule", "dualpipev",
                              "--global-batch-size", "6"])
    with pytest.raises(ConfigError, match=re.escape(
            "--pipeline-schedule dualpipev needs at least 4 microbatches per batch (its steady "
            "state pairs forwards and backwards of 2p microbatches in flight): m = "
            "global/(micro*d) = 3; raise --global-batch-size to >= 8")):
        validate_for_world(config, 2)


def test_a_bad_v_flag_ends_the_run_in_one_line():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--pipeline-schedule",
                             "zb-v", "--num-layers", "3"], cwd=root, capture_output=True,
                            text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, \
        result.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: --pipeline-schedule zb-v cuts the model")


# -- checkpoints ---------------------------------------------------------------------------------

def test_v_checkpoints_name_layers_globally_and_convert_to_and_from_v(tmp_path):
    """Saved by zb-v at p2 after 2 batches: the files read back as the trained weights under
    global layer names (rank 0 holds layers 0 and 3, the embedding and the output layer; no tied
    copy); a loop layout is refused with the conversion to run; converted to t1 x p1 and back to a
    V for v-half, a third batch reaches the weights of 3 batches in one process."""
    saved = str(tmp_path / "zbv")
    trained = run_ranks(2, train_and_save, config("zb-v", p=2), 2, saved)
    state = read_full_state(saved, show_progress=False)
    weights = full_weights(trained)
    assert state.model.keys() == set(weights)
    assert max_difference(state.model, weights, VOCAB) == 0.0
    rank0 = next(r for r in trained if r["coords"] == (0, 0, 0))["weights"]
    assert {n.split(".")[2] for n in rank0 if n.startswith("transformer.layers.")} == {"0", "3"}
    refused = run_ranks(2, load_and_train, config("interleaved", p=2, chunks=2), saved, 1)
    assert all("the model chunks in a V" in r["refused"] and "--target-virtual-pipeline-model-"
               "parallel-size 2" in r["refused"] for r in refused)
    refused = run_ranks(2, load_and_train, config("flush", p=2), saved, 1)
    assert all("--target-virtual-pipeline-model-parallel-size 1" in r["refused"] for r in refused)
    single = str(tmp_path / "t1p1")
    write_full_state(state, single, 1, 1)
    resumed = run_ranks(1, load_and_train, config("flush"), single, 1)
    straight = true_vocabulary(one_process(4, 8), VOCAB)
    assert max_difference(true_vocabulary(full_weights(resumed), VOCAB), straight, VOCAB) < 1e-5
    refused = run_ranks(2, load_and_train, config("v-half", p=2), single, 1)
    assert all("--target-pipeline-schedule v-half" in r["refused"] for r in refused)
    v_again = str(tmp_path / "vhalf")
    convert_checkpoint.main(["--load", single, "--save", v_again, "--target-tensor-parallel-size",
                             "1", "--target-pipeline-parallel-size", "2",
                             "--target-pipeline-schedule", "v-half"])
    resumed = run_ranks(2, load_and_train, config("v-half", p=2), v_again, 1)
    assert max_difference(true_vocabulary(full_weights(resumed), VOCAB), straight, VOCAB) < 1e-5
