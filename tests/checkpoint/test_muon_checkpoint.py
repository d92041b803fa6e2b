"""Checkpoints of --optimizer muon: a resumed run is bit-identical to a straight one (t=2 x p=2
under 2BW; p=2 x d=2 with the distributed optimizer, whose consolidated state holds whole momentum
buffers), the momentum buffers reshard with their matrices, and an Adam checkpoint's state is not
loaded into Muon."""
from dataclasses import dataclass

import pytest
import torch

from megatron_2bw.checkpoint import CheckpointError, load_checkpoint
from megatron_2bw.checkpoint.reshard import VOCAB_PARAMETERS
from megatron_2bw.checkpoint.save_load import load_file, model_file
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.training.stage import build_stage
from tests.checkpoint.conftest import N, ResumeRun, assert_resume_is_bit_identical
from tests.checkpoint.helpers import VOCAB, config_from_flags, pretrain_flags
from tests.checkpoint.test_reshard import _convert

MUON = ("--optimizer", "muon", "--lr", "1e-2", "--muon-momentum", "0.9", "--clip-grad", "0.5")


@dataclass
class MuonRun(ResumeRun):
    extra: tuple = ()

    def flags(self, *extra: str) -> list[str]:
        return super().flags(*MUON, *self.extra, *extra)


@pytest.fixture(scope="module")
def muon_t2p2(tmp_path_factory):
    torch.set_num_threads(1)
    run = MuonRun(2, 2, tmp_path_factory.mktemp("muon_t2p2"), [])
    assert_resume_is_bit_identical(run)
    return run


def test_t2p2_resume_is_bit_identical(muon_t2p2):
    """(asserted by the fixture) and the saved state is Muon's: momentum buffers for the
    matrices, Adam's moments for the rest."""
    saved = load_file(model_file(muon_t2p2.checkpoints, 2 * N, 0, 0))
    state = saved["optimizer"]["state"]
    matrix = "transformer.layers.0.attention.qkv.weight"
    assert set(state[matrix]) == {"momentum_buffer"}
    assert state[matrix]["momentum_buffer"].shape == saved["model"][matrix].shape
    assert state[matrix]["momentum_buffer"].any()
    assert {"exp_avg", "exp_avg_sq"} <= set(state["embedding.word_embeddings.weight"])


def test_p2d2_distributed_optimizer_resume_is_bit_identical(tmp_path):
    torch.set_num_threads(1)
    run = MuonRun(1, 2, tmp_path, [], extra=("--use-distributed-optimizer",))
    assert_resume_is_bit_identical(run)
    saved = load_file(model_file(run.checkpoints, 2 * N, 0, 0))
    for name, entry in saved["optimizer"]["state"].items():  # consolidated: whole tensors
        for value in entry.values():
            assert value.dim() == 0 or value.shape == saved["model"][name].shape, name


def test_momentum_buffers_reshard_with_their_matrices(muon_t2p2, tmp_path):
    one, back = tmp_path / "t1p1", tmp_path / "t2p2"
    _convert(muon_t2p2.checkpoints, one, 1, 1)
    _convert(one, back, 2, 2)
    for tp in range(2):
        for pp in range(2):
            a = load_file(model_file(muon_t2p2.checkpoints, 2 * N, tp, pp))
            b = load_file(model_file(str(back), 2 * N, tp, pp))
            for name, entry in a["optimizer"]["state"].items():
                for key, value in entry.items():
                    other = b["optimizer"]["state"][name][key]
                    if name in VOCAB_PARAMETERS and value.dim():  # the true vocabulary rows
                        rows = slice(None) if tp == 0 else slice(0, VOCAB - 56)
                        value, other = value[rows], other[rows]
                    assert torch.equal(value, other), (name, key)
            muon_groups = [g for g in b["optimizer"]["groups"] if g["use_muon"]]
            assert len(muon_groups) == 1 and muon_groups[0]["momentum"] == 0.9
    # the one-process checkpoint resumes under Muon: its whole matrices' buffers load
    config = config_from_flags(pretrain_flags(1, 1, 2 * N, *MUON, "--load", str(one)))
    stage = build_stage(config, ParallelLayout(1, 1, 1), torch.device("cpu"), None)
    load_checkpoint(stage, str(one))
    full = load_file(model_file(str(one), 2 * N, 0, 0))["optimizer"]["state"]
    for name, master in zip(stage.versions.names, stage.versions.master):
        if "momentum_buffer" in full.get(name, {}):
            assert torch.equal(stage.optimizer.state[master]["momentum_buffer"],
                               full[name]["momentum_buffer"])


def test_an_adam_run_does_not_load_muon_state(muon_t2p2, tmp_path):
    one = tmp_path / "t1p1"
    _convert(muon_t2p2.checkpoints, one, 1, 1)
    adam = config_from_flags(pretrain_flags(1, 1, 2 * N, "--lr", "1e-2", "--clip-grad", "0.5",
                                            "--load", str(one)))
    stage = build_stage(adam, ParallelLayout(1, 1, 1), torch.device("cpu"), None)
    with pytest.raises(CheckpointError, match="holds the state of --optimizer muon, this run uses "
                                              "--optimizer adam: pass --optimizer muon, or "
                                              "--no-load-optim"):
        load_checkpoint(stage, str(one))
