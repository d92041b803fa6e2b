"""Pipelines against independent references (fp32, dropout 0):
- Flush and GPipe (p = 2, 4; t=2 x p=2; p=2 x d=2) reach the weights of one process after 3 steps,
  also with Megatron-LM's document flags (loss mask, position and attention resets), which every
  stage reads from its own copy of the microbatch, and with Llama's architecture switches.
- 2BW (p=2; t=2 x p=2; p=2 x d=2) reaches the weights of a single-process delayed-update
  implementation (tests/pipeline/reference.py) after 5 steps, for SGD and Adam, with clipping.
- The tied word embeddings are bit-identical on the first and last stage after training."""
import functools

import pytest
import torch

from megatron_2bw.data.gpt_dataset import DocumentBoundaries
from megatron_2bw.data.mock import MockGPTDataset
from megatron_2bw.distributed.layout import ParallelLayout
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, gpt_feed, max_difference, tiny_config, train_on_ranks
from tests.pipeline.precision_harness import train_stage
from tests.pipeline.reference import delayed_update_reference

VOCAB = 101
LAYOUTS = [  # (t, p, world)
    (1, 2, 2), (1, 4, 4), (2, 2, 4), (1, 2, 4)]


def config(optimizer="sgd", **kwargs):
    return tiny_config(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 0.01, clip=0.5,
                       **kwargs)


@functools.lru_cache(maxsize=None)
def one_process(optimizer: str, batches: int):
    return full_weights(run_ranks(1, train_on_ranks, config(optimizer, schedule="flush"), batches))


@functools.lru_cache(maxsize=None)
def delayed_reference(optimizer: str, batches: int):
    c = config(optimizer)
    return delayed_update_reference(c, batches, gpt_feed(c, ParallelLayout(1, 1, 1)), 4)


@pytest.mark.parametrize("schedule", ["flush", "gpipe"])
@pytest.mark.parametrize("t,p,world", LAYOUTS)
def test_flushed_schedules_match_one_process(schedule, t, p, world):
    results = run_ranks(world, train_on_ranks, config("adam", t=t, p=p, schedule=schedule), 3)
    assert max_difference(full_weights(results), one_process("adam", 3), VOCAB) < 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("t,p,world", [(1, 2, 2), (2, 2, 4), (1, 2, 4)])
def test_2bw_matches_the_delayed_update_reference(optimizer, t, p, world):
    results = run_ranks(world, train_on_ranks, config(optimizer, t=t, p=p, schedule="2bw"), 5)
    weights = full_weights(results)
    reference = delayed_reference(optimizer, 5)
    assert max_difference(weights, reference, VOCAB) < 1e-5
    # and it is a different trajectory from vanilla (flushed) training
    assert max_difference(weights, one_process(optimizer, 5), VOCAB) > 1e-4
    # tied embeddings: the last stage's copy equals the first stage's embedding, bit for bit
    first = weights["embedding.word_embeddings.weight"]
    assert torch.equal(weights["tied_copy:output_embedding"], first)


def test_losses_agree_across_layouts():
    single = run_ranks(1, train_on_ranks, config("adam", schedule="flush"), 3)[0]["results"]
    layered = run_ranks(4, train_on_ranks, config("adam", t=2, p=2, schedule="flush"), 3)
    last = next(r["results"] for r in layered if r["coords"] == (0, 0, 1))
    for (b1, _, norm1, m1), (b2, _, norm2, m2) in zip(single, last):
        assert b1 == b2
        assert abs(m1["lm loss"] - m2["lm loss"]) < 1e-5 and abs(norm1 - norm2) < 1e-5


class PackedDocuments:
    """Mock samples with an end-of-document token at a place that varies by sample."""
    EOD = VOCAB - 1

    def __init__(self, config):
        self.mock = MockGPTDataset(10_000, config.model.seq_length, VOCAB, 7)

    def __len__(self) -> int:
        return len(self.mock)

    def __getitem__(self, index: int) -> dict:
        tokens = self.mock[index]["tokens"].copy()
        tokens[1 + index % 6] = self.EOD
        return {"tokens": tokens}


def document_feed(config, layout, document_ids=True):
    return gpt_feed(config, layout, DocumentBoundaries(PackedDocuments(config), PackedDocuments.EOD,
                                                       loss_mask=True, position_ids=True,
                                                       document_ids=document_ids))


def position_reset_feed(config, layout):
    """Positions reset, attention not: rotary embeddings depend on position differences only, so
    under --reset-attention-mask a reset would change nothing they compute."""
    return document_feed(config, layout, document_ids=False)


@pytest.mark.parametrize("t,p,world", [(1, 2, 2), (2, 2, 4)])
def test_document_flags_through_the_pipeline_match_one_process(t, p, world):
    c = config("adam", schedule="flush")
    single = run_ranks(1, train_on_ranks, c, 3, document_feed)
    results = run_ranks(world, train_on_ranks, config("adam", t=t, p=p, schedule="flush"), 3,
                        document_feed)
    assert max_difference(full_weights(results), full_weights(single), VOCAB) < 1e-5
    # and the flags changed training: the same samples without them take another trajectory
    plain = run_ranks(1, train_on_ranks, c, 3,
                      lambda c_, layout: gpt_feed(c_, layout, PackedDocuments(c_)))
    assert max_difference(full_weights(plain), full_weights(single), VOCAB) > 1e-4


UNTIED = {"untie_embeddings_and_output_weights": True}
# Llama's layout: RMSNorm, no biases, SwiGLU, rotary positions, 2 query groups of 2 heads, untied
LLAMA = {**UNTIED, "normalization": "RMSNorm", "add_bias_linear": False, "swiglu": True,
         "ffn_hidden_size": 64, "position_embedding_type": "rope", "num_query_groups": 2}


def check_flush_and_2bw(architecture: dict, feed, t: int, p: int, world: int,
                        parallel_only: dict | None = None, context: int = 1) -> dict:
    """Flush on `world` ranks reaches one process's weights, 2BW the delayed-update reference's
    (`parallel_only`: model fields the parallel runs add, e.g. sequence parallelism; `context`:
    their --context-parallel-size). Returns 2BW's weights."""
    parallel = {**architecture, **(parallel_only or {})}

    def parallel_config(optimizer: str, schedule: str):
        c = config(optimizer, t=t, p=p, schedule=schedule, **parallel)
        c.parallel.context_parallel = context
        return c
    single = full_weights(run_ranks(1, train_on_ranks, config("adam", schedule="flush",
                                                              **architecture), 3, feed))
    flushed = run_ranks(world, train_on_ranks, parallel_config("adam", "flush"), 3, feed)
    assert max_difference(full_weights(flushed), single, VOCAB) < 1e-5
    c = config("sgd", **architecture)
    reference = delayed_update_reference(c, 5, feed(c, ParallelLayout(1, 1, 1)), 4)
    two_bw = full_weights(run_ranks(world, train_on_ranks, parallel_config("sgd", "2bw"), 5, feed))
    assert max_difference(two_bw, reference, VOCAB) < 1e-5
    return two_bw


@pytest.mark.parametrize("architecture,feed", [(UNTIED, gpt_feed), (LLAMA, position_reset_feed)],
                         ids=["untied", "llama-position-resets"])
@pytest.mark.parametrize("t,p,world", [(1, 2, 2), (2, 2, 4)])
def test_architecture_switches_through_the_pipeline(architecture, feed, t, p, world):
    """--untie-embeddings-and-output-weights, and Llama's switches with --reset-position-ids (every
    stage rotates by the batch's positions): Flush reaches one process's weights and 2BW the
    delayed-update reference's, with no embedding all-reduce between first and last stage; the
    output layer then trains apart from the word embeddings."""
    two_bw = check_flush_and_2bw(architecture, feed, t, p, world)
    assert "tied_copy:output_embedding" not in two_bw
    output, embeddings = two_bw["output_layer"], two_bw["embedding.word_embeddings.weight"]
    assert output.shape == embeddings.shape and (output - embeddings).abs().max() > 1e-2


@pytest.mark.parametrize("architecture,feed", [({}, gpt_feed), (LLAMA, position_reset_feed)],
                         ids=["gpt2", "llama-position-resets"])
@pytest.mark.parametrize("t,p,world", [(2, 1, 4), (2, 2, 4)])
def test_sequence_parallel_matches_one_process(architecture, feed, t, p, world):
    """--sequence-parallel (each tensor-parallel rank holds half of the sequence between the
    layers' tensor-parallel regions, and pipeline messages carry that half): Flush reaches one
    process's weights, 2BW the delayed-update reference's; replicated norms, biases and position
    embeddings get their gradient summed over the tensor-parallel group."""
    check_flush_and_2bw(architecture, feed, t, p, world, {"sequence_parallel": True})


# Qwen3's layout: Llama's with a norm over each head's queries and keys; gains stored as gain - 1;
# heads twice hidden / heads wide
QK_NORMED = {**LLAMA, "qk_layernorm": True, "apply_layernorm_1p": True, "kv_channels": 16}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["", "sequence-parallel"])
def test_qk_layernorm_matches_one_process(sequence_parallel):
    """--qk-layernorm at t2 x p2: each tensor-parallel rank normalises its own heads' queries and
    keys with the shared gains, whose gradients are summed over the tensor-parallel group; with
    --kv-channels the attention is wider than the hidden size. Flush
    reaches one process's weights, 2BW the delayed-update reference's; the q/k gains trained."""
    two_bw = check_flush_and_2bw(QK_NORMED, position_reset_feed, 2, 2, 4,
                                 {"sequence_parallel": sequence_parallel})
    assert two_bw["transformer.layers.0.attention.q_norm.weight"].abs().max() > 0


def _overlapped_sharded(rank: int, world: int, config, batches: int) -> dict:
    """train_stage (the full master weights gathered from the shards), checking that the
    data-parallel average starts during each batch's last backward."""
    def watch(stage):
        reducer = stage.updater.backward_reducer
        assert reducer is not None, "the data-parallel average is not overlapped"
        finish = reducer.finish

        def checked():
            assert any(reducer._started), "no bucket started during the backward"
            return finish()
        reducer.finish = checked
    return train_stage(rank, world, config, batches, before=watch)


@pytest.mark.parametrize("architecture", [{}, QK_NORMED], ids=["gpt2", "qk-layernorm"])
def test_sequence_parallel_overlaps_the_sharded_average_and_matches_one_process(architecture):
    """t2 x d2 with --sequence-parallel, the distributed optimizer and --overlap-grad-reduce: the
    gradients summed over the tensor-parallel group (norms, biases, positions; the q/k gains)
    are averaged over the replicas bucket by bucket during the last backward, then summed over
    the tensor group. Flush reaches one process's weights, 2BW the delayed-update reference's."""
    def parallel_config(optimizer: str, schedule: str):
        c = config(optimizer, t=2, schedule=schedule, sequence_parallel=True, **architecture)
        c.parallel.use_distributed_optimizer = True
        c.parallel.overlap_grad_reduce = True
        c.parallel.ddp_bucket_size = 1000  # several buckets
        return c
    single = run_ranks(1, train_on_ranks, config("adam", schedule="flush", **architecture), 3)
    flushed = run_ranks(4, _overlapped_sharded, parallel_config("adam", "flush"), 3)
    assert max_difference(full_weights(flushed), full_weights(single), VOCAB) < 1e-5
    c = config("sgd", **architecture)
    reference = delayed_update_reference(c, 5, gpt_feed(c, ParallelLayout(1, 1, 1)), 4)
    two_bw = run_ranks(4, _overlapped_sharded, parallel_config("sgd", "2bw"), 5)
    assert max_difference(full_weights(two_bw), reference, VOCAB) < 1e-5


@pytest.mark.parametrize("architecture,feed,t,p,world,parallel_only", [
    ({}, gpt_feed, 1, 1, 2, {}),  # learned positions: each rank embeds its chunks' positions
    ({}, gpt_feed, 1, 1, 4, {}),  # two replicas of two context-parallel ranks each
    (LLAMA, document_feed, 1, 2, 4, {}),  # rotary, query groups, the document flags, two stages
    (LLAMA, position_reset_feed, 2, 1, 4, {"sequence_parallel": True}),
], ids=["gpt2-cp2", "gpt2-cp2-d2", "llama-documents-cp2-p2", "llama-cp2-t2-sequence-parallel"])
def test_context_parallel_matches_one_process(architecture, feed, t, p, world, parallel_only):
    """--context-parallel-size 2: each rank holds two of the four chunks of every sequence (its
    queries), and attention gathers the keys and values of all of them. Flush reaches one
    process's weights, 2BW the delayed-update reference's; with --eod-mask-loss the loss is the
    whole sequence's masked mean, and --reset-attention-mask's documents mask the gathered keys."""
    check_flush_and_2bw(architecture, feed, t, p, world, parallel_only, context=2)
