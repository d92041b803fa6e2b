"""Megatron-LM's --use-checkpoint-args and --exit-on-missing-checkpoint: a Llama-style checkpoint's
model flags need not be retyped, contradicting ones are named, and an empty --load is an error
when asked."""
import os

import pytest

from megatron_2bw.arguments import ConfigError, parse_config
from megatron_2bw.checkpoint.save_load import CheckpointError, maybe_load_checkpoint
from megatron_2bw.checkpoint.tool_config import with_checkpoint_model
from tests.checkpoint.helpers import pretrain_flags, save_random_checkpoint
from tests.pipeline.harness import stage_on_rank

LLAMA = dict(normalization="RMSNorm", add_bias_linear=False, swiglu=True, ffn_hidden_size=64,
             position_embedding_type="rope", num_query_groups=2,
             untie_embeddings_and_output_weights=True)
RUN = ["--micro-batch-size", "2", "--train-iters", "2", "--mock-data", "--vocab-size", "64"]


def model_flags_from_checkpoint(argv):
    config, args = parse_config(argv)
    return with_checkpoint_model(args, config)


def test_model_flags_come_from_the_checkpoint(tmp_path):
    saved = save_random_checkpoint(tmp_path, "gpt", 1, 1, **LLAMA).config.model
    config = model_flags_from_checkpoint([*RUN, "--load", str(tmp_path), "--use-checkpoint-args",
                                          "--tensor-model-parallel-size", "2",
                                          "--sequence-parallel"])
    for field in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                  *LLAMA):
        assert getattr(config.model, field) == getattr(saved, field), field
    assert config.model.sequence_parallel  # this run's choice, not the checkpoint's
    assert config.training.train_iters == 2  # only the model section is taken
    with pytest.raises(ConfigError, match="--hidden-size 64 contradicts the checkpoint in --load"):
        model_flags_from_checkpoint([*RUN, "--load", str(tmp_path), "--use-checkpoint-args",
                                     "--hidden-size", "64"])


def test_missing_checkpoint_is_an_error_when_asked(tmp_path):
    with pytest.raises(ConfigError, match="--use-checkpoint-args takes the model flags from the "
                                          "--load checkpoint, but --load .* holds none"):
        model_flags_from_checkpoint([*RUN, "--load", str(tmp_path), "--use-checkpoint-args"])
    config, _ = parse_config([*RUN, "--num-layers", "2", "--hidden-size", "32",
                              "--num-attention-heads", "4", "--seq-length", "16", "--load",
                              str(tmp_path), "--exit-on-missing-checkpoint"])
    _, stage = stage_on_rank(0, 1, config)
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint --load .*: no checkpoint"):
        maybe_load_checkpoint(stage)
    config.checkpoint.exit_on_missing_checkpoint = False
    assert maybe_load_checkpoint(stage) is None  # Megatron's default: start from scratch


LAYERS = ["--num-layers", "4"]


def _saved_with(root, *flags):
    """A checkpoint's metadata (no tensors) of a 2-stage run with `flags`; returns adopt(*typed):
    (config, typed fields, adopted flags) of a run resuming from it with `typed` on its command
    line."""
    from megatron_2bw.arguments import explicit_fields
    from megatron_2bw.checkpoint.save_load import (adopt_checkpoint_layout, write_marker,
                                                   write_metadata)
    saved = parse_config(pretrain_flags(1, 2, 10, *LAYERS, *flags))[0]
    os.makedirs(root / "iter_0000005")
    write_metadata(str(root), 5, 40, saved, 1, 2, 1)
    write_marker(str(root), 5)

    def adopt(*typed):
        config, args = parse_config(pretrain_flags(1, 2, 20, *LAYERS, "--load", str(root),
                                                   *typed))
        fields, adopted = adopt_checkpoint_layout(config, explicit_fields(args))
        return config, fields, adopted
    return adopt


def test_load_continues_with_the_checkpoints_layer_split_and_schedule(tmp_path):
    """Continuing a run whose split --auto-parallel chose (3,1) needs no flag repeated; a flag
    typed now wins, and the adopted fields stay pinned for --auto-parallel."""
    adopt = _saved_with(tmp_path, "--pipeline-layer-split", "3,1", "--pipeline-schedule", "flush")
    config, typed, flags = adopt()
    par = config.parallel
    assert (par.layer_split, par.pipeline_schedule) == ([3, 1], "flush")
    assert {("parallel", "layer_split"), ("parallel", "schedule")} <= typed
    assert flags == ["--pipeline-layer-split 3,1", "--pipeline-schedule flush"]
    par = adopt("--pipeline-layer-split", "2,2")[0].parallel
    assert (par.layer_split, par.pipeline_schedule) == ([2, 2], "flush")
    par = adopt("--finetune")[0].parallel  # fine-tuning keeps the split, picks its own schedule
    assert (par.layer_split, par.pipeline_schedule) == ([3, 1], "2bw")
    config, _, flags = adopt("--pipeline-model-parallel-size", "1")  # another layout: no guess
    assert flags == [] and config.parallel.layer_split is None


def test_a_repartitioning_job_resumes_where_its_layers_moved(tmp_path):
    """Under --pipeline-repartition-interval the typed split is the one the job started from: the
    checkpoint's split and recompute plan (after a migration) win; without it the typed split does."""
    adopt = _saved_with(tmp_path, "--pipeline-layer-split", "1,3",
                        "--recompute-num-layers-per-stage", "0,2")
    started = ["--pipeline-layer-split", "3,1", "--recompute-num-layers-per-stage", "2,0"]
    config, _, flags = adopt(*started, "--pipeline-repartition-interval", "2")
    assert config.parallel.layer_split == [1, 3]
    assert config.recompute.num_layers_per_stage == [0, 2]
    assert flags[:2] == ["--pipeline-layer-split 1,3 (where repartitioning moved the layers)",
                         "--recompute-num-layers-per-stage 0,2"]
    config, _, flags = adopt(*started)
    assert config.parallel.layer_split == [3, 1] and not any("split" in f for f in flags)


def test_a_tool_at_t1_loads_a_sequence_parallel_model():
    """--sequence-parallel is the run's choice, as t is: a tool (evaluation, export, conversion)
    at t = 1 takes a t = 2 --sequence-parallel checkpoint's model without it (it would refuse
    --sequence-parallel at t = 1), and keeps it where asked."""
    from megatron_2bw.arguments import build_parser
    from megatron_2bw.checkpoint.tool_config import config_with_base
    base, _ = parse_config(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                            "4", "--seq-length", "16", "--micro-batch-size", "2",
                            "--train-iters", "2", "--mock-data", "--vocab-size", "64",
                            "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert base.model.sequence_parallel
    plain = config_with_base(build_parser("tool").parse_args([]), base, "the checkpoint")
    assert not plain.model.sequence_parallel and plain.parallel.tensor_parallel == 1
    asked = config_with_base(build_parser("tool").parse_args(
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"]), base, "the checkpoint")
    assert asked.model.sequence_parallel
