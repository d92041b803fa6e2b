"""Context parallelism's pieces: which positions a rank holds (balanced causal work), the document
mask of its queries over each rank's keys, and that a rank really computes only its part of the
sequence. Its results against one process: tests/pipeline/test_pipeline_equivalence.py (and
the ring alone: tests/models/test_ring_attention.py)."""
import pytest
import torch

from megatron_2bw.arguments import ConfigError, parse_config
from megatron_2bw.config_checks import validate_for_world
from megatron_2bw.models.context_parallel import local_positions
from megatron_2bw.models.ring_attention import RingBlocks
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import gpt_feed, stage_on_rank, tiny_config


def test_each_rank_holds_two_chunks_with_equal_causal_work():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([local_positions(24, 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))
    # a query at position i attends i + 1 keys: every rank gets the same number of scores
    work = [int((local_positions(24, 3, r) + 1).sum()) for r in range(3)]
    assert work == [work[0]] * 3


@pytest.mark.parametrize("rank", [0, 1])
def test_a_blocks_mask_is_the_document_causal_mask_of_its_queries_and_keys(rank):
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    same = documents[0][:, None] == documents[0][None, :]
    blocks = RingBlocks(8, 2, rank, documents)
    assert blocks.mask(0, slice(0, 4), slice(0, 4), "cpu") is not None
    for source in (0, 1):
        rows, cols, _ = blocks.block(source)
        queries, keys = local_positions(8, 2, rank)[rows], local_positions(8, 2, source)[cols]
        assert torch.equal(blocks.mask(source, rows, cols, "cpu")[0, 0],
                           (causal & same)[queries][:, keys])
    assert RingBlocks(8, 2, rank).mask(0, slice(0, 4), slice(0, 4), "cpu") is None


def _embedded_length(rank: int, world: int) -> int:
    config = tiny_config(schedule="flush")
    config.parallel.context_parallel = 2
    layout, stage = stage_on_rank(rank, world, config)
    lengths = []
    stage.model.embedding.register_forward_hook(lambda m, i, out: lengths.append(out.shape[1]))
    stage.model(None, gpt_feed(config, layout)(0))
    return lengths[0]


def test_a_rank_embeds_and_computes_only_its_part_of_the_sequence():
    assert run_ranks(2, _embedded_length) == [4, 4]  # of --seq-length 8


@pytest.mark.parametrize("flags,world,expected", [
    (["--seq-length", "12"], 2, "--seq-length 12 must be divisible by 8"),
    ([], 3, "world size 3 is not divisible by --tensor-model-parallel-size 1 x "
            "--pipeline-model-parallel-size 1 x --context-parallel-size 4"),
])
def test_context_parallel_flags_are_checked(flags, world, expected):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2", "--mock-data",
            "--vocab-size", "64", "--context-parallel-size", "4"]
    with pytest.raises(ConfigError, match=expected):
        config, _ = parse_config([*base, *flags])
        validate_for_world(config, world)


def test_bert_refuses_context_parallelism():
    with pytest.raises(ConfigError, match="context parallelism applies to GPT pretraining only"):
        parse_config(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
                      "--mock-data", "--vocab-size", "64", "--context-parallel-size", "2"],
                     model_type="bert")
