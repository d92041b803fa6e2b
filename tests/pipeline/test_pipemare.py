"""--pipeline-schedule pipemare (pipeline/pipemare.py): the action lists give the rule stated there;
the runtime equals tests/pipeline/pipemare_reference.py to 1e-5 in fp32 (SGD and Adam, p = 2, p = 4,
t = 2 x p = 2, d = 2 with and without the distributed optimizer, with and without T1/T2); bf16 stays
within its rounding's reach of the reference; a resumed run equals a straight one bit for bit
(delta included); the memory estimate equals what a stage holds, and PipeMare's weight memory is
Flush's plus at most one weight-sized buffer, below PipeDream's on stage 0 at p = 4."""
import functools
import subprocess
import sys

import pytest
import torch

from megatron_2bw.arguments import ConfigError, parse_config
from megatron_2bw.config import PrecisionConfig
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.memory import static_breakdown
from megatron_2bw.planner.memory import estimate_stage_memory
from megatron_2bw.training.stage import compensation_tensors, pipemare_tensors
from megatron_2bw.pipeline import pipemare
from megatron_2bw.pipeline import schedules as S
from tests.checkpoint.conftest import N, ResumeRun, assert_resume_is_bit_identical
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, gpt_feed, max_difference, stage_on_rank, \
    tiny_config, train_on_ranks
from tests.pipeline.pipemare_reference import pipemare_reference
from tests.pipeline.precision_harness import precise_config, train_stage
from tests.pipeline.reference import per_stage_delay_reference
from tests.test_arguments import ROOT, TINY

VOCAB = 101
BATCHES = 5
T1, T2 = 3, 0.9  # K, D: T1's warm-up ends within the run; T2's average moves fast


# -- the action lists ------------------------------------------------------------------------

@pytest.mark.parametrize("p,m,first_batch", [(2, 1, 0), (4, 1, 0), (4, 2, 0), (4, 4, 3),
                                             (3, 5, 2)])
def test_the_action_lists_give_the_stated_rule(p, m, first_batch):
    """Counted on the lists themselves: a forward reads the updates its stage made before it,
    which is pipemare.forward_version; a backward reads the newest (its batch's index); one
    version per stage; the validator accepts them."""
    actions = S.build_schedule("pipemare", p, m, 3, first_batch)
    S.validate(actions, "pipemare", m, first_batch)
    for s, row in enumerate(actions):
        updates = first_batch
        for a in row:
            if a.kind == S.STEP:
                updates += 1
            elif a.kind == S.FORWARD:
                assert a.version == updates == pipemare.forward_version(a.microbatch, m, s, p,
                                                                        first_batch)
            elif a.kind == S.BACKWARD:
                assert a.version == updates == a.microbatch // m
        assert S.live_versions("pipemare", p, s) == 1
    # at m = 1 (the paper's setting) stage s's delay is p - 1 - s once the pipeline is full
    if m == 1 and first_batch == 0:
        assert [pipemare.microbatch_delay(8, 1, s, p) for s in range(p)] == \
            [p - 1 - s for s in range(p)]


def test_the_validator_names_a_wrong_pipemare_version():
    actions = S.build_schedule("pipemare", 4, 2, 3)
    row = actions[0]
    i = next(i for i, a in enumerate(row) if a.kind == S.FORWARD and a.version == 1)
    row[i] = S.Action(S.FORWARD, row[i].microbatch, 2)
    with pytest.raises(S.ScheduleError, match="pipemare must use version 1"):
        S.validate(actions, "pipemare", 2)


def test_the_picture_draws_backwards_on_the_newest_version(tmp_path, capsys):
    """tools/visualize_schedule.py --compare draws PipeMare from its lists: on stage 0 microbatch
    1's forward reads v0 and its backward v1 (PipeDream's backward reads its forward's v0)."""
    from tests.pipeline.test_visualize import PNG_SIGNATURE, tool
    output = tmp_path / "compare.png"
    tool.main(["--compare", "pipedream,pipemare", "--microbatches", "1", "--batches", "5",
               "--output", str(output), "--text"])
    assert output.read_bytes()[:8] == PNG_SIGNATURE
    printed = capsys.readouterr().out
    mare = S.render(S.build_schedule("pipemare", 4, 1, 5))
    assert mare in printed
    assert "F1v0" in mare.splitlines()[0] and "B1v1" in mare.splitlines()[0]
    assert "B1v0" in S.render(S.build_schedule("pipedream", 4, 1, 5)).splitlines()[0]


# -- against the reference -------------------------------------------------------------------

def config(optimizer="adam", t=1, p=2, m=2, k=0, d=0.0, data=1, distributed_optimizer=False,
           **model):
    c = tiny_config(t=t, p=p, schedule="pipemare" if p > 1 else None, optimizer=optimizer,
                    lr=0.05 if optimizer == "sgd" else 0.01, clip=0.5, global_batch=2 * m * data,
                    untie_embeddings_and_output_weights=True, **model)
    c.parallel.pipemare_lr_warmup_iters, c.parallel.pipemare_discrepancy_decay = k, d
    c.parallel.use_distributed_optimizer = distributed_optimizer
    return c


@functools.lru_cache(maxsize=None)
def reference(optimizer: str, p: int, m: int, k: int, d: float, data: int = 1) -> dict:
    c = config(optimizer, p=1, m=m, data=data)
    return pipemare_reference(c, BATCHES, gpt_feed(c, ParallelLayout(1, 1, 1)), m, p, k, d, data)


# (optimizer, t, p, m, T1 K, T2 D, d, distributed optimizer); every layout once with T1 + T2
CASES = {"p2-sgd": ("sgd", 1, 2, 2, 0, 0.0, 1, False),
         "p2-adam-t1-t2": ("adam", 1, 2, 2, T1, T2, 1, False),
         "p4-m1-adam-t1-t2": ("adam", 1, 4, 1, T1, T2, 1, False),
         "p4-m2-sgd-t1": ("sgd", 1, 4, 2, T1, 0.0, 1, False),
         "p4-m2-adam-t2": ("adam", 1, 4, 2, 0, T2, 1, False),
         "t2p2-adam-t1-t2": ("adam", 2, 2, 2, T1, T2, 1, False),
         "p2d2-adam-t2": ("adam", 1, 2, 2, 0, T2, 2, False),
         "p2d2-distributed-optimizer-adam-t1-t2": ("adam", 1, 2, 2, T1, T2, 2, True)}


@pytest.mark.parametrize("case", CASES)
def test_pipemare_matches_its_reference(case):
    optimizer, t, p, m, k, d, data, sharded = CASES[case]
    c = config(optimizer, t, p, m, k, d, data, sharded)
    # replicated gradients: averaged bucket by bucket during the batch's last backward
    c.parallel.overlap_grad_reduce = data > 1 and not sharded
    weights = full_weights(run_ranks(t * p * data, train_stage, c, BATCHES))
    expected = reference(optimizer, p, m, k, d, data)
    assert max_difference(weights, expected, VOCAB) < 1e-5
    if k or d:  # T1 / T2 changed the trajectory
        assert max_difference(expected, reference(optimizer, p, m, 0, 0.0, data), VOCAB) > 1e-4


def test_the_backward_reads_the_newest_weights():
    """At m = 1 PipeMare's forwards read PipeDream's versions; only the backward's weights differ
    (PipeDream stashes the forward's), and that changes the trajectory."""
    c = config("adam", p=1, m=1)
    stashed = per_stage_delay_reference(c, BATCHES, gpt_feed(c, ParallelLayout(1, 1, 1)), 1,
                                        "pipedream", stages=4, clip="stage")
    assert max_difference(reference("adam", 4, 1, 0, 0.0), stashed, VOCAB) > 1e-4


def test_sequence_parallel_weights_are_read_at_backward_time_too():
    """--sequence-parallel's linear layers save their weight in an autograd.Function of their own
    (tensor_parallel/layers.py): the hooks reach those saved weights as well."""
    c = config("adam", t=2, p=2, m=2, k=T1, d=T2, sequence_parallel=True)
    weights = full_weights(run_ranks(4, train_stage, c, BATCHES))
    assert max_difference(weights, reference("adam", 2, 2, T1, T2), VOCAB) < 1e-5


def test_selective_recomputation_keeps_the_rule():
    """--recompute-activations re-runs the attention core alone, which reads no weights."""
    c = config("adam", p=2, m=2, k=T1, d=T2)
    c.recompute.granularity = "selective"
    weights = full_weights(run_ranks(2, train_on_ranks, c, BATCHES))
    assert max_difference(weights, reference("adam", 2, 2, T1, T2), VOCAB) < 1e-5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_pipemare_stays_near_the_fp32_reference(precision):
    """bf16 (or fp16 with a static loss scale) working weights, fp32 master weights, against the
    fp32 reference: the differences are the roundings of the weights, the activations and T2's
    prediction (relative 2^-8 in bf16, 2^-11 in fp16), which perturb the gradients. Adam moves
    an element by about lr per step whatever its gradient's scale, so two runs whose gradients
    differ drift apart by at most about 2 lr per step and element; asserted: half that worst
    case, BATCHES * lr (a wrong rule is not caught by this bound: the fp32 tests catch that)."""
    lr = 0.01
    c = precise_config(precision, p=2, schedule="pipemare", optimizer="adam", lr=lr, clip=0.5,
                       global_batch=4, untie_embeddings_and_output_weights=True)
    if precision == "fp16":  # each stage decides its steps alone: a static scale
        c.precision = PrecisionConfig(fp16=True, loss_scale=2.0 ** 10)
    c.parallel.pipemare_lr_warmup_iters, c.parallel.pipemare_discrepancy_decay = T1, T2
    ranks = run_ranks(2, train_stage, c, BATCHES)
    assert all(r["working_dtype"] == getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[
        precision]) for r in ranks)
    assert not any(skipped for r in ranks for _, skipped, *_ in r["results"])
    difference = max_difference(full_weights(ranks), reference("adam", 2, 2, T1, T2), VOCAB)
    assert difference < BATCHES * lr, difference


def _pipemare_host_reads(rank: int, world: int, global_batch: int):
    """tests/pipeline/test_host_syncs.py's count, of a PipeMare run with T1 and T2."""
    from tests.pipeline import test_host_syncs

    def pipemare_config(**kwargs):
        c = tiny_config(**kwargs, schedule="pipemare", untie_embeddings_and_output_weights=True)
        c.parallel.pipemare_lr_warmup_iters, c.parallel.pipemare_discrepancy_decay = T1, T2
        return c
    test_host_syncs.tiny_config = pipemare_config  # this forked rank's copy of the module
    return test_host_syncs._count(rank, world, global_batch)


def test_pipemare_reads_the_device_only_at_steps():
    """No host read per microbatch (the saved-weight hooks and T2's prediction run on the
    device): per step the metrics and the stage's gradient norm, as under 2BW."""
    from megatron_2bw.distributed.forked import run_forked
    two = run_forked(4, _pipemare_host_reads, 8, timeout=120)  # m = 2 per replica
    four = run_forked(4, _pipemare_host_reads, 16, timeout=120)  # m = 4
    for (per_step, timed_waits), (per_step_4, timed_waits_4) in zip(two, four):
        assert timed_waits == timed_waits_4 == 0
        assert per_step == per_step_4 and max(per_step) <= 2, (per_step, per_step_4)


# -- checkpoints -----------------------------------------------------------------------------

class PipeMareResume(ResumeRun):
    def flags(self, *extra: str) -> list[str]:
        # --eval-interval N: the straight run drains where the interrupted one stops (a
        # segment's end drains the pipeline, which PipeMare's forward versions depend on)
        return super().flags("--pipeline-schedule", "pipemare",
                             "--untie-embeddings-and-output-weights", "--eval-interval", str(N),
                             "--pipemare-lr-warmup-iters", str(T1),
                             "--pipemare-discrepancy-decay", str(T2),
                             "--use-distributed-optimizer", "--lr-decay-style", "constant",
                             *extra)


def test_resumed_pipemare_is_bit_identical(tmp_path):
    """2N iterations straight, or N, save, load and N more (p = 2 x d = 2, distributed optimizer,
    T1 and T2, dropout on): the same losses and weights bit for bit, so delta was saved."""
    assert_resume_is_bit_identical(PipeMareResume(1, 2, tmp_path, []))


# -- memory ----------------------------------------------------------------------------------

def _stage_memory(rank: int, world: int, config) -> dict:
    """Bytes this rank's stage holds at start by kind, and the estimate's, with its stage."""
    layout, stage = stage_on_rank(rank, world, config)
    estimate = estimate_stage_memory(config.model, config.parallel, config.precision,
                                     config.recompute, config.optimizer.optimizer,
                                     config.training.micro_batch_size, stage.microbatches,
                                     layout.data, layout.stage)
    held = static_breakdown(stage.versions, stage.optimizer, compensation_tensors(stage),
                            pipemare_tensors(stage))
    return {"stage": layout.stage, "held": held, "parameters": sum(stage.versions.layout.numels),
            "estimate": {key: getattr(estimate, key) for key in held}}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pipemare_weight_memory(precision):
    """p = 4, T2 on: each stage holds what the estimate says; its weights (params + stash: one
    version, T2's delta) are at most Flush's plus one fp32 weight-sized buffer, and stage 0's are
    below PipeDream's (whose stage 0 stashes p versions)."""
    def startup(schedule, decay=0.0):
        c = precise_config(precision, p=4, schedule=schedule, optimizer="adam", global_batch=8,
                           untie_embeddings_and_output_weights=True)
        c.parallel.pipemare_discrepancy_decay = decay
        return sorted(run_ranks(4, _stage_memory, c), key=lambda r: r["stage"])

    def weights(r):
        return r["held"]["params"] + r["held"]["versions_stash"]
    flush, pipedream, mare = startup("flush"), startup("pipedream"), startup("pipemare", T2)
    for s, (f, pd, pm) in enumerate(zip(flush, pipedream, mare)):
        assert pm["held"] == pytest.approx(pm["estimate"]), pm
        assert weights(pm) <= weights(f) + 4 * pm["parameters"], (pm, f)
        assert (pm["held"]["versions_stash"] > 0) == (s < 3)  # no delay on the last: no delta
        if s == 0:
            assert weights(pm) < weights(pd), (pm, pd)


# -- bad input -------------------------------------------------------------------------------

PIPEMARE = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "pipemare",
            "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("extra,expected", [
    (["--pipeline-model-parallel-size", "2", "--pipemare-lr-warmup-iters", "10"],
     "--pipemare-lr-warmup-iters applies to --pipeline-schedule pipemare only, not to "
     "--pipeline-schedule 2bw"),
    (["--pipemare-discrepancy-decay", "0.5"],
     "--pipemare-discrepancy-decay applies to --pipeline-schedule pipemare only"),
    ([*PIPEMARE, "--pipemare-discrepancy-decay", "1.0"],
     "--pipemare-discrepancy-decay must be in [0, 1) (0: T2 off), got 1.0"),
    ([*PIPEMARE, "--pipemare-lr-warmup-iters", "-1"],
     "--pipemare-lr-warmup-iters must be >= 0 (0: T1 off), got -1"),
    ([*PIPEMARE, "--delay-compensation", "predict"],
     "--delay-compensation predict applies to --pipeline-schedule 2bw or pipedream only, not to "
     "--pipeline-schedule pipemare"),
    (PIPEMARE[:4], "--pipeline-schedule pipemare needs --untie-embeddings-and-output-weights"),
    ([*PIPEMARE, "--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--pipeline-schedule pipemare keeps no forward-time weights"),
    ([*PIPEMARE, "--fp16"], "--pipeline-schedule pipemare --fp16 needs a static --loss-scale"),
    ([*PIPEMARE, "--num-layers-per-virtual-pipeline-stage", "1"],
     "apply to --pipeline-schedule interleaved only (got pipemare)"),
    ([*PIPEMARE, "--torch-compile"], "drop --torch-compile"),
    ([*PIPEMARE, "--rampup-batch-size", "2", "2", "100"],
     "drop --rampup-batch-size / --step-batch-size-schedule"),
    ([*PIPEMARE, "--pipeline-repartition-interval", "5"],
     "--pipeline-repartition-interval does not apply to --pipeline-schedule pipemare"),
])
def test_bad_pipemare_flags_are_one_line_config_errors(extra, expected):
    with pytest.raises(ConfigError) as error:
        parse_config([*TINY, "--global-batch-size", "4", *extra])
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_bad_pipemare_flag_stops_the_launch_with_one_line_and_exit_2():
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--global-batch-size", "4",
                             *PIPEMARE, "--pipemare-discrepancy-decay", "1.5"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0] == "pretrain_gpt.py: error: --pipemare-discrepancy-decay must be in [0, 1) " \
                       "(0: T2 off), got 1.5"


# -- the planner -----------------------------------------------------------------------------

def test_the_planner_plans_pipemare_only_where_pinned():
    """Left to itself the search never puts PipeMare's update rule in place of another schedule;
    pinned (--pipeline-schedule pipemare), it plans it at 2BW's bubble-free speed with one weight
    version per stage, and T2's delta as the stages' stash (none on the last, whose delay is 0)."""
    from megatron_2bw.config import ModelConfig, ParallelConfig, PrecisionConfig
    from megatron_2bw.planner.hardware import load_hardware
    from megatron_2bw.planner.search import SearchSpace, candidates, rank_plans
    model = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                        vocab_size=5000, untie_embeddings_and_output_weights=True)
    hardware = load_hardware("p3.16xlarge")
    assert "pipemare" not in {c.schedule for c in candidates(model, 16, hardware.for_world(16), 32)}
    space = SearchSpace(tensor_parallel=(1,), pipeline_parallel=(4,), micro_batch_sizes=(2,),
                        recompute=(None,), schedules=("2bw", "pipemare"))
    t2 = ParallelConfig(pipemare_discrepancy_decay=T2)
    for parallel in (None, t2):
        plans = {p.candidate.schedule: p for p in rank_plans(
            model, 4, hardware, 8, PrecisionConfig(), parallel=parallel, space=space)}
        two_bw, mare = plans["2bw"], plans["pipemare"]
        assert abs(mare.time_per_batch_s / two_bw.time_per_batch_s - 1) < 0.10
        for s, (ours, theirs) in enumerate(zip(mare.stage_memory, two_bw.stage_memory)):
            assert theirs.versions_stash > 0
            # fp32: the one working copy is the master weights; delta has its size
            expected = ours.params if parallel is t2 and s < 3 else 0
            assert ours.versions_stash == expected, (s, ours)
