"""Save/load: exact resume (2BW, dropout on) for t=2 x p=2, p=2 x d=2 and p=2 x cp=2, an
interrupted save leaves the previous checkpoint as latest, and layout or model mismatches are
named."""
import os

import pytest
import torch

from megatron_2bw.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_2bw.checkpoint.save_load import (MARKER, check_layout, maybe_load_checkpoint,
                                               read_marker, rng_file)
from megatron_2bw.config import Config
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.tensor_parallel.random import rng_state_dict
from megatron_2bw.training.stage import build_stage
from tests.checkpoint.conftest import N
from tests.checkpoint.helpers import (config_from_flags, logged_losses, pretrain_flags,
                                      save_random_checkpoint)


@pytest.mark.parametrize("run_name", ["t2p2_run", "p2d2_run", "p2cp2_run"])
def test_resumed_training_is_bit_identical_to_straight_training(run_name, request):
    run = request.getfixturevalue(run_name)
    straight = logged_losses(run.root / "straight.jsonl")
    first, second = logged_losses(run.root / "first.jsonl"), logged_losses(run.root / "second.jsonl")
    assert [i for i, _ in first] == list(range(1, N + 1))  # stopped and saved at N ...
    assert [i for i, _ in second] == list(range(N + 1, 2 * N + 1))  # ... resumed after it
    assert first + second == straight  # every loss, bit for bit
    for rank in run.ranks:
        assert rank["straight"].keys() == rank["resumed"].keys()
        for name, weight in rank["straight"].items():
            assert torch.equal(weight, rank["resumed"][name]), name
    # with dropout, skipping the RNG restore would change the trajectory: the states were saved
    assert os.path.exists(rng_file(run.checkpoints, N, 0, 0, 0))


def _stage(flags):
    config = config_from_flags(flags)
    return build_stage(config, ParallelLayout(1, 1, 1), torch.device("cpu"), None)


def _saved_at_iteration_3(root):
    """A stage saved at iteration 3 into `root`, now at iteration 4; its flags and saved weights."""
    flags = pretrain_flags(1, 1, 10, "--save", str(root), "--load", str(root))
    stage = _stage(flags)
    stage.iteration, stage.consumed_samples = 3, 6
    save_checkpoint(stage)
    saved = [m.detach().clone() for m in stage.versions.master]
    stage.iteration = 4
    return flags, stage, saved


def _assert_iteration_3_is_latest_and_intact(root, flags, saved):
    assert read_marker(str(root)) == 3
    assert not [f for _, _, files in os.walk(root) for f in files if ".tmp" in f]
    fresh = _stage(flags)
    maybe_load_checkpoint(fresh)
    assert (fresh.iteration, fresh.consumed_samples) == (3, 6)
    for m, expected in zip(fresh.versions.master, saved):
        assert torch.equal(m, expected)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    flags, stage, saved = _saved_at_iteration_3(tmp_path)
    with torch.no_grad():
        for m in stage.versions.master:
            m.add_(1.0)
    real_save, calls = torch.save, []

    def dying_save(obj, path, *args, **kwargs):  # the first file is written, the second is not
        calls.append(path)
        if len(calls) > 1:
            raise OSError("disk full")
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(stage)
    monkeypatch.setattr(torch, "save", real_save)
    _assert_iteration_3_is_latest_and_intact(tmp_path, flags, saved)


def test_loading_another_layout_names_both_layouts_and_the_conversion_tool(tmp_path):
    save_random_checkpoint(tmp_path, "gpt", t=2, p=2)
    stage = _stage(pretrain_flags(1, 1, 10))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(stage, str(tmp_path))
    message = str(error.value)
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in message
    assert "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1" in message
    assert "tools/convert_checkpoint.py" in message


def test_a_different_model_is_refused_by_name(tmp_path):
    save_random_checkpoint(tmp_path, "gpt", t=1, p=1)
    stage = _stage(pretrain_flags(1, 1, 10, "--hidden-size", "64"))
    with pytest.raises(CheckpointError, match="hidden_size = 32.*--hidden-size"):
        load_checkpoint(stage, str(tmp_path))
    deeper = _stage(pretrain_flags(1, 1, 10, "--num-layers", "3"))  # named as such, not as a split
    with pytest.raises(CheckpointError, match="num_layers = 2, this run has 3.*--num-layers"):
        load_checkpoint(deeper, str(tmp_path))


def test_finetune_loads_weights_only_and_an_empty_load_dir_starts_from_scratch(tmp_path, capsys):
    state = save_random_checkpoint(tmp_path / "ckpt", "gpt", t=1, p=1)
    stage = _stage(pretrain_flags(1, 1, 10, "--load", str(tmp_path / "ckpt"), "--finetune"))
    before = rng_state_dict()["torch"]
    assert maybe_load_checkpoint(stage) is None  # no RNG states to restore
    assert torch.equal(rng_state_dict()["torch"], before)
    assert (stage.iteration, stage.versions.newest) == (0, 0)
    names = stage.versions.names
    word = stage.versions.master[names.index("embedding.word_embeddings.weight")]
    assert torch.equal(word[:101], state.model["embedding.word_embeddings.weight"])
    assert not word[101:].any()  # vocabulary padding rows

    empty = _stage(pretrain_flags(1, 1, 10, "--load", str(tmp_path / "nothing")))
    assert maybe_load_checkpoint(empty) is None and empty.iteration == 0
    assert f"{MARKER} is missing): training starts from scratch" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="--finetune --load"):
        maybe_load_checkpoint(_stage(pretrain_flags(1, 1, 10, "--load", str(tmp_path / "nothing"),
                                                    "--finetune")))


def test_a_checkpoint_with_another_layer_split_names_the_split_to_pass():
    saved = Config()
    saved.model.num_layers, saved.parallel.pipeline_parallel = 4, 2
    saved.parallel.layer_split = [3, 1]  # e.g. chosen by --auto-parallel
    metadata = {"layout": {"tensor": 1, "pipeline": 2}, "iteration": 300, "config": saved.to_dict()}
    current = Config.from_dict(saved.to_dict())
    check_layout(metadata, "ckpt", current)  # the same split loads
    current.parallel.layer_split = None  # the default, even split: 2,2
    with pytest.raises(CheckpointError, match="saved with --pipeline-layer-split 3,1, but this run "
                                              "splits the layers 2,2: pass --pipeline-layer-split 3,1"):
        check_layout(metadata, "ckpt", current)


def _saved_at_3(tmp_path, *flags):
    stage = _stage(pretrain_flags(1, 1, 10, "--save", str(tmp_path), *flags))
    stage.iteration, stage.consumed_samples = 3, 24
    save_checkpoint(stage)


def test_a_resume_with_another_lr_schedule_is_refused_unless_a_flag_says_which_wins(tmp_path):
    """Megatron-LM's rule: a changed --train-iters (the decay's default length) or --lr on resume
    is an error; --override-opt_param-scheduler keeps the flags', and
    --use-checkpoint-opt_param-scheduler continues the checkpoint's."""
    from megatron_2bw.optim.lr_schedule import learning_rate
    _saved_at_3(tmp_path)
    longer = pretrain_flags(1, 1, 20, "--load", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"--lr-decay-iters \(default --train-iters\): 10 in "
                       r"the checkpoint, 20 now.*--use-checkpoint-opt_param-scheduler"):
        load_checkpoint(_stage(longer), str(tmp_path))
    kept = _stage(longer + ["--use-checkpoint-opt_param-scheduler"])
    load_checkpoint(kept, str(tmp_path))
    saved = config_from_flags(pretrain_flags(1, 1, 10))
    continued = [learning_rate(k, kept.config.optimizer, kept.config.training) for k in range(3, 12)]
    assert continued == [learning_rate(k, saved.optimizer, saved.training) for k in range(3, 12)]
    overridden = _stage(longer + ["--lr", "5e-4", "--override-opt_param-scheduler"])
    load_checkpoint(overridden, str(tmp_path))
    assert overridden.config.optimizer.lr == 5e-4
    assert overridden.config.optimizer.lr_decay_iters is None  # --train-iters 20 decides
    with pytest.raises(CheckpointError, match="contradict"):
        load_checkpoint(_stage(longer + ["--override-opt_param-scheduler",
                                         "--use-checkpoint-opt_param-scheduler"]), str(tmp_path))
    load_checkpoint(_stage(pretrain_flags(1, 1, 10)), str(tmp_path))  # the same: no flag needed


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_model_file_is_named_with_its_rank(tmp_path, damage):
    _saved_at_3(tmp_path)
    path = tmp_path / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"not a checkpoint")
    with pytest.raises(CheckpointError, match=rf"rank 0 .*{path}: cannot be read \(.*\): the file "
                       r"is damaged or truncated"):
        load_checkpoint(_stage(pretrain_flags(1, 1, 10)), str(tmp_path))


def _load_reporting(rank, world, flags, root):
    from megatron_2bw.checkpoint import CheckpointError as Refused
    from tests.pipeline.harness import stage_on_rank
    _, stage = stage_on_rank(rank, world, config_from_flags(flags))
    try:
        load_checkpoint(stage, root)
    except Refused as error:
        return str(error)
    return "loaded"


def test_a_damaged_file_of_one_rank_stops_every_rank_and_none_reports_loaded(tmp_path, capfd):
    from tests.checkpoint.helpers import save_random_checkpoint
    from tests.distributed_helpers import run_ranks
    save_random_checkpoint(tmp_path, "gpt", 1, 2)
    path = tmp_path / "iter_0000007" / "mp_rank_00_001" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:100])
    messages = run_ranks(2, _load_reporting, pretrain_flags(1, 2, 8), str(tmp_path), timeout=300)
    assert messages[0] == messages[1], messages  # the same line on every rank, none waits
    assert messages[0].startswith("loading the checkpoint failed on rank 1 (tp=0/1, dp=0/1, "
                                  f"pp=1/2): {path}: cannot be read"), messages[0]
    assert "loaded checkpoint" not in capfd.readouterr().out


def test_a_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(tmp_path,
                                                                             monkeypatch):
    """ENOSPC met half-way into the model file (inside torch's serializer, which wraps it in a
    RuntimeError): one line saying "no space left on device", the marker and files of the
    previous checkpoint untouched and loadable, no temporary file left behind."""
    import errno

    from megatron_2bw.checkpoint import save_load
    flags, stage, saved = _saved_at_iteration_3(tmp_path)

    class FullDisk:  # the module's files, on a disk that fills after 1000 bytes
        def __init__(self, path, mode="r"):
            self.file, self.written = open(path, mode), 0

        def write(self, data):
            self.written += len(data)
            if self.written > 1000:
                raise OSError(errno.ENOSPC, "No space left on device", self.file.name)
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(save_load, "open", FullDisk, raising=False)
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(stage)
    monkeypatch.undo()
    message = str(error.value)
    assert message.startswith(f"saving iteration 4 to {tmp_path} failed on rank 0 "), message
    assert "no space left on device (" in message and "model_optim_rng.pt.tmp" in message
    assert message.endswith(f"{MARKER} still names iteration 3, which is intact")
    assert "\n" not in message
    _assert_iteration_3_is_latest_and_intact(tmp_path, flags, saved)
