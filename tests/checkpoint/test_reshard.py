"""Resharding: the trained t=2 x p=2 checkpoint converted to t=1 x p=1 computes the same loss, and
converted back it holds the same weights, 2BW versions and optimizer state; a Llama-style model
reshards too."""
import pytest
import torch

from megatron_2bw.checkpoint.reshard import (VOCAB_PARAMETERS, check_layout_fits, shard_of,
                                             write_full_state)
from megatron_2bw.checkpoint.save_load import (CheckpointError, check_architecture, load_file,
                                               model_file)
from tests.checkpoint.conftest import N
from tests.checkpoint.helpers import (VOCAB, config_from_flags, eval_tokens, evaluate_checkpoint,
                                      pretrain_flags, random_model_state, save_random_checkpoint,
                                      whole_model)
from tests.data.helpers import load_tool
from tests.distributed_helpers import run_ranks


def _convert(source, target, t, p):
    load_tool("convert_checkpoint").main(["--load", str(source), "--save", str(target),
                                          "--target-tensor-parallel-size", str(t),
                                          "--target-pipeline-parallel-size", str(p)])


def test_t2p2_to_t1p1_and_back_keeps_the_loss_and_the_state(t2p2_run, tmp_path):
    one, back = tmp_path / "t1p1", tmp_path / "t2p2"
    _convert(t2p2_run.checkpoints, one, 1, 1)
    _convert(one, back, 2, 2)

    original_loss = next(r["final_loss"] for r in t2p2_run.ranks if r["final_loss"] is not None)
    flags = pretrain_flags(1, 1, 2 * N)
    converted_loss = run_ranks(1, evaluate_checkpoint, flags, str(one))[0]
    assert converted_loss == pytest.approx(original_loss, abs=1e-5)

    for tp in range(2):
        for pp in range(2):
            a = load_file(model_file(t2p2_run.checkpoints, 2 * N, tp, pp))
            b = load_file(model_file(str(back), 2 * N, tp, pp))
            assert (b["iteration"], b["consumed_samples"]) == (a["iteration"], a["consumed_samples"])
            assert list(b["model"]) == list(a["model"]) and b["specs"] == a["specs"]
            rows = slice(None) if tp == 0 else slice(0, VOCAB - 56)  # the true vocabulary rows

            def same(x, y, name):
                cut = rows if name in VOCAB_PARAMETERS else slice(None)
                return torch.equal(x[cut], y[cut])

            for name in a["model"]:
                if tp == 1 and name in VOCAB_PARAMETERS:  # rank 1 holds rows 56..111: 45 real
                    assert not b["model"][name][VOCAB - 56:].any()  # re-padded with zeros
                assert same(a["model"][name], b["model"][name], name), name
                for version in a["versions"]:
                    assert same(a["versions"][version][name], b["versions"][version][name], name)
                for key, value in a["optimizer"]["state"][name].items():
                    other = b["optimizer"]["state"][name][key]
                    assert same(value, other, name) if value.dim() else torch.equal(value, other)
            assert sorted(a["versions"]) == [2 * N - 1, 2 * N]  # both 2BW versions travelled
            assert b["loss_scaler"] == a["loss_scaler"]
            groups = lambda f: [sorted(g["params"]) for g in f["optimizer"]["groups"]]  # noqa: E731
            assert groups(b) == groups(a)


def test_a_layout_the_model_cannot_take_is_refused(tmp_path):
    full = random_model_state("gpt")
    with pytest.raises(CheckpointError, match="--target-tensor-parallel-size 3 .* divide"):
        check_layout_fits(full.config.model, 3, 1, "--target-tensor-parallel-size")
    with pytest.raises(CheckpointError, match="--pipeline-model-parallel-size 3 .*--num-layers 2"):
        write_full_state(full, str(tmp_path), 1, 3)
    grouped = random_model_state("gpt", num_query_groups=2)  # 4 heads in 2 groups
    with pytest.raises(CheckpointError, match="--target-tensor-parallel-size 4 .* --num-query-groups 2"):
        check_layout_fits(grouped.config.model, 4, 1, "--target-tensor-parallel-size")


def test_shards_pad_the_vocabulary_with_zeros_and_cut_along_the_partition_dim():
    full = torch.arange(10 * 4.0).view(10, 4)
    shard = shard_of(full, "embedding.word_embeddings.weight", (16, 4), 0, 1, 2)
    assert torch.equal(shard[:2], full[8:]) and not shard[2:].any()
    column = shard_of(full, "transformer.layers.0.mlp.fc2.weight", (10, 4), 1, 1, 2)
    assert torch.equal(column, full[:, 2:])
    with pytest.raises(CheckpointError, match="shape"):
        shard_of(full, "final_norm.weight", (12, 4), None, 0, 1)


# Llama's switches, with Qwen3's query/key norms and zero-centred gains
LLAMA_FIELDS = dict(normalization="RMSNorm", add_bias_linear=False, swiglu=True, ffn_hidden_size=64,
                    position_embedding_type="rope", num_query_groups=2,
                    untie_embeddings_and_output_weights=True, qk_layernorm=True,
                    apply_layernorm_1p=True)
LLAMA_FLAGS = ["--normalization", "RMSNorm", "--disable-bias-linear", "--swiglu",
               "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups",
               "2", "--untie-embeddings-and-output-weights", "--qk-layernorm",
               "--apply-layernorm-1p"]


def test_llama_layout_reshards_by_whole_query_groups_and_gate_up_pairs(tmp_path):
    """Grouped qkv rows and alternating gate/up rows cut into contiguous shards: a random Llama-style
    model written at t=2 x p=2, and converted to t=1 x p=1, computes one process's loss."""
    state = save_random_checkpoint(tmp_path / "t2p2", "gpt", 2, 2, **LLAMA_FIELDS)
    tokens = eval_tokens()
    model = whole_model(state)
    with torch.no_grad():
        expected = sum(float(model(None, {"tokens": tokens[2 * k:2 * k + 2]})[0]) for k in range(2)) / 2
    sharded = run_ranks(4, evaluate_checkpoint, pretrain_flags(2, 2, 8, *LLAMA_FLAGS),
                        str(tmp_path / "t2p2"))
    assert next(loss for loss in sharded if loss is not None) == pytest.approx(expected, abs=1e-5)
    _convert(tmp_path / "t2p2", tmp_path / "t1p1", 1, 1)
    single = run_ranks(1, evaluate_checkpoint, pretrain_flags(1, 1, 8, *LLAMA_FLAGS),
                       str(tmp_path / "t1p1"))[0]
    assert single == pytest.approx(expected, abs=1e-5)
    # without --normalization RMSNorm it does not load, and the message names the flag
    layer_norm = config_from_flags(pretrain_flags(1, 1, 8, *LLAMA_FLAGS[2:]))
    with pytest.raises(CheckpointError, match="normalization = 'RMSNorm', this run has 'LayerNorm' "
                                              "\\(set by --normalization"):
        check_architecture(state.config, layer_norm, "ckpt")
    without_qk_norms = config_from_flags(pretrain_flags(1, 1, 8, *LLAMA_FLAGS[:-2]))
    with pytest.raises(CheckpointError, match="qk_layernorm = True, this run has False "
                                              "\\(set by --qk-layernorm"):
        check_architecture(state.config, without_qk_norms, "ckpt")
