"""--sequence-parallel layers on t = 2 against one process (fp32): a column-parallel then
row-parallel pair fed this rank's half of the sequence returns this rank's half of the reference
output, with the reference's input gradient and (reassembled, summed) weight gradients; the
vocabulary-parallel embedding returns this rank's half of the lookups."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_2bw.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                 VocabParallelEmbedding, initialize_parameters,
                                                 sum_tensor_partial_grads)
from tests.distributed_helpers import run_ranks
from tests.tensor_parallel.test_layers import _full, _full_grad

HIDDEN, FFN, SEQ, VOCAB = 8, 12, 6, 16


def _sequence_parallel_pair(rank, world):
    group = dist.new_group(list(range(world)))
    fc1 = ColumnParallelLinear(HIDDEN, FFN, group, sequence_parallel=True)
    fc2 = RowParallelLinear(FFN, HIDDEN, group, sequence_parallel=True)
    for layer in (fc1, fc2):
        initialize_parameters(layer, seed=3, std=0.5, num_layers=2)
        layer.bias.data.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(4))
    x = torch.randn(3, SEQ, HIDDEN, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(3, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    part = slice(rank * SEQ // world, (rank + 1) * SEQ // world)

    x_part = x[:, part].clone().requires_grad_()
    y_part = fc2(F.gelu(fc1(x_part)))
    (y_part * upstream[:, part]).sum().backward()
    sum_tensor_partial_grads([fc2.bias.grad], [fc2.bias.spec], group)

    reference = {name: _full(p).clone().requires_grad_() for name, p in
                 [("w1", fc1.weight), ("b1", fc1.bias), ("w2", fc2.weight), ("b2", fc2.bias)]}
    x_ref = x.clone().requires_grad_()
    y_ref = F.linear(F.gelu(F.linear(x_ref, reference["w1"], reference["b1"])), reference["w2"],
                     reference["b2"])
    (y_ref * upstream).sum().backward()
    assert y_part.shape == (3, SEQ // world, HIDDEN)
    torch.testing.assert_close(y_part, y_ref[:, part], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_part.grad, x_ref.grad[:, part], atol=1e-5, rtol=1e-5)
    for name, param in [("w1", fc1.weight), ("b1", fc1.bias), ("w2", fc2.weight), ("b2", fc2.bias)]:
        torch.testing.assert_close(_full_grad(param), reference[name].grad, atol=1e-5, rtol=1e-5)
    assert fc2.bias.spec.tensor_partial_grad and not fc1.bias.spec.tensor_partial_grad

    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, group, sequence_parallel=True)
    initialize_parameters(embedding, seed=5, std=0.5, num_layers=2)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(embedding(ids), F.embedding(ids, _full(embedding.weight))[:, part])


def test_sequence_parallel_layers_match_one_process():
    run_ranks(2, _sequence_parallel_pair)


def _stage_activations(rank, world):
    from tests.pipeline.harness import stage_on_rank, tiny_config
    config = tiny_config(t=2, p=2, schedule="flush", sequence_parallel=True)
    layout, stage = stage_on_rank(rank, world, config)
    batch = {"tokens": torch.randint(0, 101, (2, config.model.seq_length + 1),
                                     generator=torch.Generator().manual_seed(0))}
    sharded = [name for name, spec in zip(stage.versions.names, stage.versions.specs)
               if spec.tensor_partial_grad]
    hidden = stage.model.embedding(batch["tokens"][:, :-1]) if layout.stage == 0 else None
    return stage.executor.p2p.shape, None if hidden is None else tuple(hidden.shape), sharded


def test_a_stage_holds_and_sends_half_of_the_sequence():
    """t=2 x p=2 with --sequence-parallel: pipeline messages and the embedding's output are
    [b, s/2, h]; the layers' norms and row-parallel biases and the position table are the
    parameters whose gradients are summed over the tensor-parallel group."""
    results = run_ranks(4, _stage_activations)
    for shape, embedded, sharded in results:
        assert shape == (2, 4, 32)  # micro batch 2, sequence 8 / 2, hidden 32
        assert embedded in (None, (2, 4, 32))
        assert any(name.endswith("input_norm.weight") for name in sharded)
        assert any(name.endswith("dense.bias") for name in sharded)
    assert "embedding.position_embeddings" in results[0][2]
