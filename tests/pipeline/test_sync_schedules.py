"""The vanilla schedules beyond Flush and GPipe: zb-h1 (backward split into B and W) and
Megatron-LM's interleaved 1F1B (model chunks per rank).

- Their lists pass the validator, keep the documented in-flight limits and beat Flush's bubble;
  broken lists (W before B, a reduce before a W, transfers out of order) are rejected.
- On real gloo ranks (fp32) they reach one process's weights at p=2, p=4, t2 x p2 and p2 x d2,
  and with recomputation and the distributed optimizer (ZeRO-1); in fp16 and bf16 they end where
  Flush ends in the same precision. Interleaved checkpoints name the layers globally, so they
  reshard to and from any layout.
- Megatron-LM's virtual-stage flags select the interleaved schedule; bad ones are named."""
import dataclasses
import functools
import os
import re
import subprocess
import sys

import pytest

from megatron_2bw.arguments import ConfigError, parse_config
from megatron_2bw.config_checks import validate_for_world
from megatron_2bw.checkpoint.reshard import read_full_state, write_full_state
from megatron_2bw.config import RecomputeConfig
from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.interleaved import warmup_forwards
from megatron_2bw.planner.cost import StageCost, time_per_batch_lower_bound
from megatron_2bw.planner.memory import estimate_stage_memory
from megatron_2bw.planner.simulator import compiled_schedule, simulate
from tests.distributed_helpers import run_ranks
from tests.pipeline.checkpoint_helpers import load_and_train, train_and_save, true_vocabulary
from tests.pipeline.harness import (evaluate_on_ranks, full_weights, max_difference, tiny_config,
                                    train_on_ranks)
from tests.pipeline.precision_harness import precise_config, train_stage

VOCAB = 101
LAYOUTS = [(1, 2, 2), (1, 4, 4), (2, 2, 4), (1, 2, 4)]  # (t, p, world)


# -- the lists ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,stages,microbatches,chunks", [
    ("zb-h1", 2, 2, 1), ("zb-h1", 4, 4, 1), ("zb-h1", 4, 9, 1), ("zb-h1", 8, 8, 1),
    ("interleaved", 2, 2, 2), ("interleaved", 2, 6, 3), ("interleaved", 4, 4, 2),
    ("interleaved", 4, 8, 2), ("interleaved", 3, 9, 4)])
def test_generated_lists_are_valid_and_post_the_right_receives(schedule, stages, microbatches,
                                                               chunks):
    actions = S.build_schedule(schedule, stages, microbatches, 3, 2, chunks)
    S.validate(actions, schedule, microbatches, 2)
    for stage, stage_list in enumerate(actions):
        kinds = [a.kind for a in stage_list]
        assert S.stage_receives(stages, microbatches, 3, stage, chunks) == \
            {"act": kinds.count(S.RECV_ACT), "grad": kinds.count(S.RECV_GRAD)}
        chunks_seen = {a.chunk for a in stage_list if a.kind == S.FORWARD}
        assert chunks_seen == set(range(chunks))


def _peak_in_flight(stage_list) -> int:
    live = peak = 0
    for a in stage_list:
        live += (a.kind == S.FORWARD) - (a.kind in (S.BACKWARD, S.BACKWARD_WEIGHT))
        peak = max(peak, live)
    return peak


def test_zb_h1_holds_1f1b_peak_memory_and_splits_every_backward():
    p, m = 4, 8
    zb, flush = S.build_schedule("zb-h1", p, m, 2), S.build_schedule("flush", p, m, 2)
    # activations live from forward to W: every stage holds at most p, 1F1B's first stage's peak
    assert [_peak_in_flight(row) for row in zb] == [p] * p
    assert max(_peak_in_flight(row) for row in flush) == p
    for row in zb:
        kinds = [a.kind for a in row]
        assert S.BACKWARD not in kinds
        assert kinds.count(S.BACKWARD_INPUT) == kinds.count(S.BACKWARD_WEIGHT) == 2 * m
    # the last stage defers p - 1 W passes into the drain, the first none
    last = [a.kind for a in zb[-1] if a.kind in S.COMPUTE_KINDS][:3 * p]
    assert last[:2 * (p - 1)] == [S.FORWARD, S.BACKWARD_INPUT] * (p - 1)


def test_interleaved_follows_megatrons_order_and_warmup():
    p, m, v = 4, 8, 2
    actions = S.build_schedule("interleaved", p, m, 1, 0, v)
    for stage, row in enumerate(actions):
        forwards = [(a.chunk, a.microbatch) for a in row if a.kind == S.FORWARD]
        # microbatches in groups of p through chunk 0, then chunk 1, then the next group
        assert forwards[:2 * p] == [(0, k) for k in range(p)] + [(1, k) for k in range(p)]
        backwards = [(a.chunk, a.microbatch) for a in row if a.kind == S.BACKWARD]
        assert backwards[:p] == [(1, k) for k in range(p)]  # the last chunk's first
        computes = [a.kind for a in row if a.kind in S.COMPUTE_KINDS]
        warmup = (p - stage - 1) * 2 + (v - 1) * p
        assert warmup_forwards(p, m, stage, v) == warmup
        assert computes[:warmup + 1] == [S.FORWARD] * (warmup + 1)
        assert computes[warmup + 1] == S.BACKWARD
        assert _peak_in_flight(row) == S.max_in_flight("interleaved", p, m, stage, v) == warmup + 1
    # m = p: every forward first, as Megatron-LM does
    assert warmup_forwards(p, p, p - 1, v) == p * v


def _bubble(schedule: str, p: int, m: int, chunks: int = 1) -> float:
    """Idle share of a batch with forward 1, backward 2 (B 1 + W 1), a chunk 1/v of the stage."""
    durations = {S.FORWARD: 1.0, S.BACKWARD: 2.0, S.BACKWARD_INPUT: 1.0, S.BACKWARD_WEIGHT: 1.0}
    timed = S.timeline(S.build_schedule(schedule, p, m, 1, 0, chunks),
                       lambda stage, a: durations.get(a.kind, 0.0) / chunks)
    end = max(t.end for row in timed for t in row)
    return 1.0 - sum(t.end - t.start for row in timed for t in row) / (end * p)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_and_interleaved_bubbles_are_below_flushs(p, m):
    flush = _bubble("flush", p, m)
    assert flush == pytest.approx(3 * (p - 1) / (3 * m + 3 * (p - 1)))  # (p-1)/(m+p-1)
    assert _bubble("zb-h1", p, m) < 0.6 * flush
    assert _bubble("interleaved", p, m, 2) < 0.7 * flush


def _stage0(schedule: str, chunks: int = 1) -> list:
    return [list(row) for row in S.build_schedule(schedule, 2, 4, 1, 0, chunks)]


def test_the_validator_rejects_broken_split_and_chunked_lists():
    actions = _stage0("zb-h1")
    row = actions[1]
    b = next(i for i, a in enumerate(row) if a.kind == S.BACKWARD_INPUT)
    w = next(i for i, a in enumerate(row) if a.kind == S.BACKWARD_WEIGHT and
             a.microbatch == row[b].microbatch)
    broken = [list(r) for r in actions]
    broken[1][b], broken[1][w] = broken[1][w], broken[1][b]
    with pytest.raises(S.ScheduleError, match="weight gradient without a preceding"):
        S.validate(broken, "zb-h1", 4)
    dropped = [list(r) for r in actions]
    last_w = max(i for i, a in enumerate(dropped[0]) if a.kind == S.BACKWARD_WEIGHT)
    dropped[0].pop(last_w)
    with pytest.raises(S.ScheduleError, match="reduced before every backward"):
        S.validate(dropped, "zb-h1", 4)
    # chunked: two activation receives of stage 1 swapped (transfers carry no microbatch number)
    actions = _stage0("interleaved", 2)
    receives = [i for i, a in enumerate(actions[1]) if a.kind == S.RECV_ACT][:2]
    swapped = [list(r) for r in actions]
    first, second = receives
    swapped[1][first], swapped[1][second] = (dataclasses.replace(actions[1][first],
                                                                 microbatch=1),
                                             dataclasses.replace(actions[1][second],
                                                                 microbatch=0))
    with pytest.raises(S.ScheduleError):
        S.validate(swapped, "interleaved", 4)


def test_bad_shapes_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiple of stages"):
        S.build_schedule("interleaved", 4, 6, 1, 0, 2)
    with pytest.raises(ValueError, match="one model chunk"):
        S.build_schedule("zb-h1", 2, 4, 1, 0, 2)
    with pytest.raises(ValueError, match="m=1 < p=2"):
        S.build_schedule("zb-h1", 2, 1, 1)


def test_pictures_name_the_split_and_the_chunks():
    assert "W: weight gradient" in S.render(S.build_schedule("zb-h1", 2, 2, 1))
    text = S.render(S.build_schedule("interleaved", 2, 2, 1, 0, 2))
    assert "F0.1v0" in text and "chunk c" in text


# -- real ranks ----------------------------------------------------------------------------------

def config(schedule="flush", layers=4, chunks=None, **kwargs):
    c = tiny_config(optimizer="adam", lr=0.01, clip=0.5, schedule=schedule, layers=layers,
                    **kwargs)
    c.parallel.virtual_pipeline_parallel = chunks
    return c


@functools.lru_cache(maxsize=None)
def one_process(layers: int, global_batch: int = 8):
    return full_weights(run_ranks(1, train_on_ranks, config(layers=layers,
                                                            global_batch=global_batch), 3))


@pytest.mark.parametrize("t,p,world", LAYOUTS)
def test_zb_h1_matches_one_process(t, p, world):
    results = run_ranks(world, train_on_ranks, config("zb-h1", t=t, p=p), 3)
    assert max_difference(full_weights(results), one_process(4), VOCAB) < 1e-5


@pytest.mark.parametrize("t,p,world,global_batch", [(1, 2, 2, 16), (1, 4, 4, 8), (2, 2, 4, 8),
                                                    (1, 2, 4, 8)])
def test_interleaved_matches_one_process(t, p, world, global_batch):
    layers = 2 * p  # two chunks of one layer per rank
    c = config("interleaved", layers=layers, chunks=2, t=t, p=p, global_batch=global_batch)
    results = run_ranks(world, train_on_ranks, c, 3)
    assert max_difference(full_weights(results), one_process(layers, global_batch), VOCAB) < 1e-5


@pytest.mark.parametrize("schedule,chunks", [("zb-h1", None), ("interleaved", 2)])
def test_recomputation_and_the_distributed_optimizer_match_one_process(schedule, chunks):
    recomputed = config(schedule, chunks=chunks, p=2)
    recomputed.recompute = RecomputeConfig("full", "uniform", 1)
    results = run_ranks(2, train_on_ranks, recomputed, 3)
    assert max_difference(full_weights(results), one_process(4), VOCAB) < 1e-5
    zero1 = config(schedule, chunks=chunks, p=2)
    zero1.parallel.use_distributed_optimizer = True  # p2 x d2: each replica steps half
    results = run_ranks(4, train_stage, zero1, 3)  # (it gathers the full master weights)
    assert max_difference(full_weights(results), one_process(4), VOCAB) < 1e-5


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_ends_where_flush_ends(precision):
    def run(schedule, chunks=None):
        c = precise_config(precision, p=2, schedule=schedule, optimizer="sgd", lr=2.0)
        c.parallel.virtual_pipeline_parallel = chunks
        return run_ranks(2, train_stage, c, 6, None, True)
    flush = run("flush")
    for ranks in (run("zb-h1"), run("interleaved", 2)):
        assert max_difference(full_weights(ranks), full_weights(flush), VOCAB) < 1e-3
        for mine, theirs in zip(ranks, flush):
            assert [r[:2] for r in mine["results"]] == [r[:2] for r in theirs["results"]]


# -- flags ---------------------------------------------------------------------------------------

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "16", "--micro-batch-size", "2", "--train-iters", "2", "--mock-data", "--vocab-size", "64",
        "--pipeline-model-parallel-size", "2"]


def test_megatrons_virtual_stage_flags_select_interleaved():
    config, _ = parse_config([*TINY, "--num-layers-per-virtual-pipeline-stage", "1",
                              "--global-batch-size", "8"])
    assert config.parallel.pipeline_schedule == "interleaved"
    assert config.parallel.model_chunks == 2  # 4 layers / p 2 / 1 per chunk
    config, _ = parse_config([*TINY, "--pipeline-schedule", "interleaved",
                              "--virtual-pipeline-model-parallel-size", "2"])
    assert config.parallel.model_chunks == 2
    config, _ = parse_config([*TINY, "--pipeline-schedule", "zb-h1"])
    assert config.parallel.pipeline_schedule == "zb-h1" and config.parallel.model_chunks == 1


@pytest.mark.parametrize("extra,expected", [
    (["--pipeline-schedule", "interleaved"], "needs --virtual-pipeline-model-parallel-size V or"),
    (["--pipeline-schedule", "flush", "--virtual-pipeline-model-parallel-size", "2"],
     "apply to --pipeline-schedule interleaved only"),
    (["--virtual-pipeline-model-parallel-size", "3"], "--num-layers 4 must be divisible by"),
    (["--num-layers-per-virtual-pipeline-stage", "2"], "at least 2 model chunks per rank, got 1"),
    (["--virtual-pipeline-model-parallel-size", "2", "--pipeline-layer-split", "1,3"],
     "--pipeline-layer-split does not apply"),
])
def test_bad_virtual_stage_flags_are_named(extra, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_config([*TINY, *extra])


def test_interleaved_refuses_m_not_a_multiple_of_p():
    """m = 6 / (2 x 1) = 3 microbatches on p = 2 stages."""
    config, _ = parse_config([*TINY, "--global-batch-size", "6",
                              "--virtual-pipeline-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match=re.escape(
            "needs the microbatches per batch to be a multiple of --pipeline-model-parallel-size "
            "(each chunk takes them in groups of p): m = global/(micro*d) = 3, p = 2; make "
            "--global-batch-size a multiple of 4")):
        validate_for_world(config, 2)


def test_a_bad_schedule_flag_ends_the_run_in_one_line():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--pipeline-schedule",
                             "interleaved"], cwd=root, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, \
        result.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: --pipeline-schedule interleaved needs")


# -- checkpoints ---------------------------------------------------------------------------------

def test_interleaved_checkpoints_name_layers_globally_and_reshard(tmp_path):
    """Saved by p2 x v2 after 2 batches: the files read back as the trained weights; converted to
    t1 x p1 (and back to p2 x v2) a third batch reaches the weights of 3 batches in one process;
    another chunking is refused with the conversion to run."""
    saved = str(tmp_path / "interleaved")
    trained = run_ranks(2, train_and_save, config("interleaved", chunks=2, p=2), 2, saved)
    state = read_full_state(saved, show_progress=False)
    weights = full_weights(trained)
    assert state.model.keys() == {k for k in weights if not k.startswith("tied_copy:")}
    assert max_difference(state.model, weights, VOCAB) == 0.0
    refused = run_ranks(2, load_and_train, config("flush", p=2), saved, 1)
    assert all("--target-virtual-pipeline-model-parallel-size 1" in r["refused"] for r in refused)
    single = str(tmp_path / "t1p1")
    write_full_state(state, single, 1, 1)
    resumed = run_ranks(1, load_and_train, config("flush"), single, 1)
    straight = true_vocabulary(one_process(4), VOCAB)
    assert max_difference(true_vocabulary(full_weights(resumed), VOCAB), straight, VOCAB) < 1e-5
    rechunked = str(tmp_path / "p2v2")
    write_full_state(read_full_state(single, show_progress=False), rechunked, 1, 2, chunks=2)
    resumed = run_ranks(2, load_and_train, config("interleaved", chunks=2, p=2), rechunked, 1)
    assert max_difference(true_vocabulary(full_weights(resumed), VOCAB), straight, VOCAB) < 1e-5


# -- the planner's simulator and memory estimate -------------------------------------------------

def test_the_simulator_replays_split_backwards_and_chunks():
    """Forward 1, backward 2 (B 1.1 + W 0.9), p = 4, m = 8, no communication: Flush takes
    (m + p - 1) x 3 per batch; ZB-H1 and interleaved (chunks of half the time) less, at the
    in-flight counts of the lists (chunk-microbatches for interleaved), and never below m x 3 plus
    the fill a lower bound names."""
    durations = [StageCost(1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0)] * 4
    flush = simulate(compiled_schedule("flush", 4, 8, 3), durations)
    zb = simulate(compiled_schedule("zb-h1", 4, 8, 3), durations)
    interleaved = simulate(compiled_schedule("interleaved", 4, 8, 3, 2), durations)
    assert flush.time_per_batch == pytest.approx(11 * 3.0)
    assert 8 * 3.0 < zb.time_per_batch < 0.85 * flush.time_per_batch
    assert 8 * 3.0 < interleaved.time_per_batch < 0.9 * flush.time_per_batch
    assert zb.peak_inflight_microbatches == [4] * 4
    assert interleaved.peak_inflight_microbatches == [
        S.max_in_flight("interleaved", 4, 8, s, 2) for s in range(4)]
    for schedule, chunks, result in (("zb-h1", 1, zb), ("interleaved", 2, interleaved)):
        assert time_per_batch_lower_bound(durations, schedule, 8, chunks) <= \
            result.time_per_batch + 1e-9


def test_the_memory_estimate_counts_each_schedules_activations():
    def activations(schedule, stage, chunks=None):
        c = tiny_config(p=4, schedule=schedule, layers=8)
        c.parallel.virtual_pipeline_parallel = chunks
        return estimate_stage_memory(c.model, c.parallel, c.precision, c.recompute, "adam", 2, 8,
                                     1, stage).activations
    assert activations("zb-h1", 3) == pytest.approx(4 * activations("flush", 3))
    assert activations("zb-h1", 0) == pytest.approx(activations("flush", 0))
    # interleaved, stage 0: (v-1) p + 2p - 1 = 11 chunk-microbatches of half the stage
    assert activations("interleaved", 1, 2) == pytest.approx(
        S.max_in_flight("interleaved", 4, 8, 1, 2) / 2 / 3 * activations("flush", 1))
    assert activations("interleaved", 0, 2) == pytest.approx(11 / 2 / 4 * activations("flush", 0))


def test_interleaved_evaluation_matches_one_process():
    """Forward-only through the chunks in the interleaved order: the last rank's loss sums."""
    single = run_ranks(1, evaluate_on_ranks, config())[0]
    chunked = run_ranks(2, evaluate_on_ranks, config("interleaved", chunks=2, p=2))[1]
    assert chunked["weight"] == single["weight"] == 4.0
    assert chunked["sums"]["lm loss"] == pytest.approx(single["sums"]["lm loss"], abs=1e-5)


def test_auto_parallel_keeps_the_typed_virtual_stages():
    """--auto-parallel with --virtual-pipeline-model-parallel-size: the search plans interleaved
    with that v (pinned like every typed flag), not another schedule or v."""
    from megatron_2bw.arguments import explicit_fields
    from megatron_2bw.planner.hardware import load_hardware
    from megatron_2bw.planner.search import candidates, pinned_search_space
    flags = [*TINY[:-2], "--num-layers", "8", "--pipeline-model-parallel-size", "2",
             "--virtual-pipeline-model-parallel-size", "4", "--global-batch-size", "16"]
    config, args = parse_config(flags)
    space = pinned_search_space(config, explicit_fields(args))
    assert space.schedules == ("interleaved",) and space.chunks == 4
    pool = candidates(config.model, 8, load_hardware("dgx-a100"), 16, space)
    assert pool and {(c.schedule, c.chunks, c.pipeline_parallel) for c in pool} == \
        {("interleaved", 4, 2)}
