"""--delay-compensation predict|dc|ef|nesterov under 2BW against
tests/pipeline/compensation_reference.py (fp32, dropout 0, clipping on): p = 2, p = 4,
t = 2 x p = 2 and p = 2 x d = 2 with the distributed optimizer, SGD, Adam and (ef, nesterov)
Muon, to 1e-5; each a different trajectory from uncompensated 2BW. bf16 trains like fp32;
an fp16 overflow skips the step with compensation on; a resumed run equals a straight one bit for
bit (the saved versions and delta)."""
import functools
import re
import subprocess
import sys

import pytest

from megatron_2bw.distributed.layout import ParallelLayout
import megatron_2bw.optim.muon as muon
from tests.checkpoint.conftest import ResumeRun, assert_resume_is_bit_identical
from tests.distributed_helpers import run_ranks
from tests.optim.test_muon_parallel import newton_schulz_float64
from tests.pipeline.compensation_reference import compensated_reference
from tests.pipeline.harness import full_weights, gpt_feed, max_difference, tiny_config
from tests.pipeline.precision_harness import precise_config, train_stage
from tests.pipeline.test_memory import _startup_report
from tests.test_arguments import ROOT, TINY

VOCAB = 101
BATCHES = 5
# large enough that a missing or wrong correction moves the weights far beyond 1e-5
DC_LAMBDA = 5000.0
# ef's beta and nesterov's gamma: the defaults (None), written out for the reference
COEFFICIENT = {"dc": DC_LAMBDA, "ef": 1.0, "nesterov": 0.5, "predict": None, "none": None}


def config(optimizer: str, mode: str, t: int = 1, p: int = 1, distributed_optimizer=False):
    c = tiny_config(t=t, p=p, schedule="2bw" if p > 1 else None, optimizer=optimizer,
                    lr=0.05 if optimizer == "sgd" else 0.01, clip=0.5)
    c.parallel.delay_compensation = mode
    c.parallel.delay_compensation_lambda = DC_LAMBDA if mode == "dc" else None  # else default
    c.parallel.use_distributed_optimizer = distributed_optimizer
    return c


@functools.lru_cache(maxsize=None)
def reference(optimizer: str, mode: str):
    c = config(optimizer, mode)
    return compensated_reference(c, BATCHES, gpt_feed(c, ParallelLayout(1, 1, 1)), 4, mode,
                                 coefficient=COEFFICIENT[mode])


@functools.lru_cache(maxsize=None)
def pipedream_reference(mode: str, vertical_sync: bool):
    """PipeDream at p = 4, one microbatch of 2 samples per update (its own setting)."""
    c = pipedream_config(mode, vertical_sync)
    c.parallel.pipeline_parallel, c.parallel.schedule = 1, None
    delay = (lambda s: 3) if vertical_sync else (lambda s: 3 - s)
    return compensated_reference(c, BATCHES + 1, gpt_feed(c, ParallelLayout(1, 1, 1)), 1, mode,
                                 stages=4, delay=delay, clip_per_stage=not vertical_sync)


def pipedream_config(mode: str, vertical_sync: bool):
    c = tiny_config(p=4, schedule="pipedream", optimizer="adam", lr=0.01, clip=0.5, global_batch=2,
                    untie_embeddings_and_output_weights=True)
    c.parallel.vertical_sync = vertical_sync
    c.parallel.delay_compensation = mode
    return c


@pytest.mark.parametrize("vertical_sync", [False, True], ids=["pipedream", "vertical-sync"])
def test_predicted_pipedream_matches_its_reference(vertical_sync):
    """Stage s extrapolates over its own delay (3 - s, or 3 under vertical sync)."""
    weights = full_weights(run_ranks(4, train_stage, pipedream_config("predict", vertical_sync),
                                     BATCHES + 1))
    expected = pipedream_reference("predict", vertical_sync)
    assert max_difference(weights, expected, VOCAB) < 1e-5
    assert max_difference(expected, pipedream_reference("none", vertical_sync), VOCAB) > 1e-4


LAYOUTS = {"p2": (1, 2, 2, False), "p4": (1, 4, 4, False), "t2p2": (2, 2, 4, False),
           "p2d2-distributed-optimizer": (1, 2, 4, True)}
# every layout with Adam and predict, ef, nesterov; SGD and dc where they add a code path
# (suite time)
CASES = [(mode, optimizer, layout) for layout in LAYOUTS
         for mode in ("predict", "dc", "ef", "nesterov") for optimizer in ("sgd", "adam")
         if layout == "p2" or optimizer == "adam" or mode == "predict"
         or (mode in ("ef", "nesterov") and optimizer == "adam")]
# Muon (the hidden matrices orthogonalised whole, over t and ZeRO shards) with ef everywhere the
# layout changes how a matrix is held, nesterov on p2
CASES += [("ef", "muon", layout) for layout in ("p2", "t2p2", "p2d2-distributed-optimizer")]
CASES += [("nesterov", "muon", "p2")]


@pytest.mark.parametrize("mode,optimizer,layout", CASES)
def test_compensated_2bw_matches_its_reference(mode, optimizer, layout, monkeypatch):
    if optimizer == "muon":  # Newton-Schulz in float64: layouts compared exactly (see there)
        monkeypatch.setattr(muon, "newton_schulz", newton_schulz_float64)
    t, p, world, sharded = LAYOUTS[layout]
    c = config(optimizer, mode, t, p, sharded)
    weights = full_weights(run_ranks(world, train_stage, c, BATCHES))
    assert max_difference(weights, reference(optimizer, mode), VOCAB) < 1e-5
    # the compensation changed the trajectory: uncompensated 2BW ends elsewhere
    assert max_difference(reference(optimizer, mode), reference(optimizer, "none"), VOCAB) > 1e-4


@pytest.mark.parametrize("mode", ["predict", "dc", "ef", "nesterov"])
def test_bf16_compensated_2bw_trains_like_fp32(mode):
    def run(precision):
        # nesterov's look-ahead lengthens Adam's step by up to 1/(1 - gamma): half the rate
        lr = 0.005 if mode == "nesterov" else 0.01
        c = precise_config(precision, p=2, schedule="2bw", optimizer="adam", lr=lr)
        c.parallel.delay_compensation = mode
        return run_ranks(2, train_stage, c, 8, None, True)
    fp32, bf16 = run("fp32"), run("bf16")
    losses = [m["lm loss"] for _, _, _, _, m in next(r for r in bf16 if r["coords"][2] == 1)["results"]]
    fp32_losses = [m["lm loss"] for _, _, _, _, m in
                   next(r for r in fp32 if r["coords"][2] == 1)["results"]]
    assert fp32_losses[-1] < fp32_losses[0] - 0.2  # it learns
    assert abs(losses[-1] - fp32_losses[-1]) <= 0.02 * fp32_losses[-1]
    assert max_difference(full_weights(bf16), full_weights(fp32), VOCAB) < 0.05


class CompensatedResume(ResumeRun):
    def __init__(self, root, mode: str, *extra: str):
        super().__init__(1, 2, root, [])
        self.extra = ("--delay-compensation", mode, *extra)

    def flags(self, *extra: str) -> list[str]:
        return super().flags(*self.extra, *extra)


@pytest.mark.parametrize("mode,extra", [
    ("dc", ("--delay-compensation-lambda", str(DC_LAMBDA), "--use-distributed-optimizer")),
    ("predict", ()), ("ef", ("--use-distributed-optimizer",)), ("nesterov", ())],
    ids=["dc-p2d2-distributed-optimizer", "predict-p2d2", "ef-p2d2-distributed-optimizer",
         "nesterov-p2d2"])
def test_resumed_compensated_training_is_bit_identical(tmp_path, mode, extra):
    """Train 2N iterations straight, or N, save, load and N more (2BW, p = 2 x d = 2, dropout on):
    the same losses and weights bit for bit, so the saved versions and delta are the ones used."""
    assert_resume_is_bit_identical(CompensatedResume(tmp_path, mode, *extra))


def refused(mode: str, schedule: str, applies: str = "2bw") -> tuple[list[str], str]:
    """A p = 2 run of `schedule` with --delay-compensation `mode`, and the line it must print."""
    return (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
             "--untie-embeddings-and-output-weights", "--delay-compensation", mode],
            f"--delay-compensation {mode} applies to --pipeline-schedule {applies} only, not to "
            f"--pipeline-schedule {schedule}")


@pytest.mark.parametrize("extra,expected", [
    refused("predict", "flush", "2bw or pipedream"), refused("dc", "pipedream"),
    refused("ef", "flush"), refused("nesterov", "pipemare"),
    (["--delay-compensation", "dc"],  # p = 1: the schedule is flush
     "--delay-compensation dc applies to --pipeline-schedule 2bw only, not to "
     "--pipeline-schedule flush"),
    (["--pipeline-model-parallel-size", "2", "--delay-compensation", "predict",
      "--delay-compensation-lambda", "0.1"],
     "--delay-compensation-lambda applies to --delay-compensation dc, ef or nesterov only"),
    (["--pipeline-model-parallel-size", "2", "--delay-compensation", "nesterov",
      "--delay-compensation-lambda", "1"],
     "--delay-compensation-lambda (nesterov's gamma) must be < 1, got 1.0"),
    (["--pipeline-model-parallel-size", "2", "--delay-compensation", "dc",
      "--delay-compensation-lambda", "-1"], "--delay-compensation-lambda must be >= 0, got -1.0"),
    (["--delay-compensation", "guess"], "argument --delay-compensation: invalid choice"),
])
def test_bad_compensation_flags_give_one_line(extra, expected):
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--global-batch-size", "4",
                             *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert expected in lines[0] and lines[0].startswith("pretrain_gpt.py: error: ")


@pytest.mark.parametrize("precision,mode,distributed", [
    ("fp32", "predict", False), ("fp32", "dc", True), ("bf16", "predict", True),
    ("fp32", "ef", False), ("bf16", "nesterov", True)])
def test_the_memory_estimate_counts_the_compensation_state(precision, mode, distributed):
    """What a stage holds at start, by kind, equals the estimate: delta (one fp32 copy of this
    rank's master-weight shard; ef two) and, for predict in fp32, master weights of their own."""
    config = precise_config(precision, schedule="2bw", optimizer="adam", layers=2)
    config.parallel.use_distributed_optimizer = distributed
    plain = run_ranks(2, _startup_report, config)
    config.parallel.delay_compensation = mode
    compensated = run_ranks(2, _startup_report, config)
    for before, line in zip(plain, compensated):
        estimated, held = line.split("; held at start ")
        for kind in ("params", "grads", "optimizer state", "version stash"):
            number = re.compile(re.escape(kind) + r" ([0-9.]+)")
            assert number.search(held).group(1) == number.search(estimated).group(1), line
        grew = {kind: float(re.search(re.escape(kind) + r" ([0-9.]+)", line.split("; held")[1])
                            .group(1)) - float(re.search(re.escape(kind) + r" ([0-9.]+)",
                                                         before.split("; held")[1]).group(1))
                for kind in ("params", "optimizer state")}
        assert grew["optimizer state"] > 0  # delta
        assert (grew["params"] > 0) == (precision == "fp32" and mode == "predict")
