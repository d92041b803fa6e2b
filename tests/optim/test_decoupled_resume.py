"""A run with the embeddings' own schedule (--decoupled-lr), the weight-decay increment and
--lr-warmup-init, on p=2 x d=2 with the distributed optimizer: resumed from a checkpoint it
continues bit for bit (the scenario of tests/checkpoint/conftest.py), and the checkpoint's
optimizer holds the decoupled groups of both stages."""
from dataclasses import dataclass

import torch

from megatron_2bw.checkpoint.save_load import load_file, model_file
from tests.checkpoint.conftest import N, ResumeRun, _resume_scenario
from tests.checkpoint.helpers import logged_losses
from tests.distributed_helpers import run_ranks

SCHEDULE_FLAGS = ("--use-distributed-optimizer", "--decoupled-lr", "3e-3",
                  "--decoupled-min-lr", "2e-4", "--lr-warmup-init", "1e-4", "--lr-warmup-iters",
                  "2", "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.01",
                  "--end-weight-decay", "0.1")


@dataclass
class DecoupledResumeRun(ResumeRun):
    def flags(self, *extra: str) -> list[str]:
        return super().flags(*SCHEDULE_FLAGS, *extra)


def test_a_run_with_decoupled_groups_resumes_bit_identically(tmp_path):
    torch.set_num_threads(1)
    run = DecoupledResumeRun(1, 2, tmp_path, [])
    ranks = run_ranks(4, _resume_scenario, run, timeout=300)
    straight = logged_losses(run.root / "straight.jsonl")
    first, second = logged_losses(run.root / "first.jsonl"), logged_losses(run.root / "second.jsonl")
    assert [i for i, _ in first + second] == list(range(1, 2 * N + 1))
    assert first + second == straight
    for rank in ranks:
        for name, weight in rank["straight"].items():
            assert torch.equal(weight, rank["resumed"][name]), name
    for stage, weights in ((0, "embedding.word_embeddings.weight"), (1, "output_embedding")):
        groups = load_file(model_file(run.checkpoints, N, 0, stage))["optimizer"]["groups"]
        assert [g["params"] for g in groups if g["is_decoupled_lr"]] == [[weights]]
