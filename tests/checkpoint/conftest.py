"""The resume scenario, run once per layout and shared by the tests that need a trained checkpoint:
on 4 forked gloo ranks, train 2N iterations straight; then train N (--exit-interval N saves and
stops), load and train N more (saving at the end)."""
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_2bw.training.loop import pretrain
from tests.checkpoint.helpers import config_from_flags, evaluate_checkpoint, logged_losses, \
    pretrain_flags
from tests.distributed_helpers import run_ranks

N = 2  # iterations before the interruption (and after it)


@dataclass
class ResumeRun:
    t: int
    p: int
    root: Path  # straight.jsonl, first.jsonl, second.jsonl and checkpoints/
    ranks: list  # per rank: {"straight": weights, "resumed": weights, "final_loss": float | None}
    context: int = 1  # --context-parallel-size

    @property
    def checkpoints(self) -> str:
        return str(self.root / "checkpoints")

    def flags(self, *extra: str) -> list[str]:
        # 2 microbatches per batch: the fewest 2BW takes
        data_parallel = 4 // (self.t * self.p * self.context)
        return pretrain_flags(self.t, self.p, 2 * N, "--global-batch-size", str(4 * data_parallel),
                              "--context-parallel-size", str(self.context), *extra)


def _master_weights(stage) -> dict:
    return {name: m.detach().clone() for name, m in zip(stage.versions.names, stage.versions.master)}


def _resume_scenario(rank: int, world: int, run: ResumeRun) -> dict:
    ckpt = run.checkpoints
    straight = pretrain(config_from_flags(run.flags("--log-file", str(run.root / "straight.jsonl"))))
    pretrain(config_from_flags(run.flags("--log-file", str(run.root / "first.jsonl"), "--save", ckpt,
                                         "--exit-interval", str(N))))
    resumed = pretrain(config_from_flags(run.flags("--log-file", str(run.root / "second.jsonl"),
                                                   "--save", ckpt, "--load", ckpt)))
    return {"straight": _master_weights(straight), "resumed": _master_weights(resumed),
            "final_loss": evaluate_checkpoint(rank, world, run.flags(), ckpt)}


def assert_resume_is_bit_identical(run: ResumeRun) -> list:
    """Run the resume scenario on 4 ranks: the interrupted run logs iterations 1 .. 2N with the
    straight run's losses, and ends with its master weights, bit for bit. Returns the ranks'
    results."""
    run.ranks = run_ranks(4, _resume_scenario, run, timeout=300)
    straight = logged_losses(run.root / "straight.jsonl")
    resumed = logged_losses(run.root / "first.jsonl") + logged_losses(run.root / "second.jsonl")
    assert [i for i, _ in resumed] == list(range(1, 2 * N + 1)) and resumed == straight
    for rank in run.ranks:
        for name, weight in rank["straight"].items():
            assert torch.equal(weight, rank["resumed"][name]), name
    return run.ranks


def _run(tmp_path_factory, t: int, p: int, context: int = 1) -> ResumeRun:
    torch.set_num_threads(1)
    run = ResumeRun(t, p, tmp_path_factory.mktemp(f"resume_t{t}_p{p}_cp{context}"), [], context)
    run.ranks = run_ranks(4, _resume_scenario, run, timeout=300)
    return run


@pytest.fixture(scope="session")
def t2p2_run(tmp_path_factory) -> ResumeRun:
    return _run(tmp_path_factory, 2, 2)


@pytest.fixture(scope="session")
def p2d2_run(tmp_path_factory) -> ResumeRun:
    return _run(tmp_path_factory, 1, 2)


@pytest.fixture(scope="session")
def p2cp2_run(tmp_path_factory) -> ResumeRun:
    return _run(tmp_path_factory, 1, 2, context=2)
