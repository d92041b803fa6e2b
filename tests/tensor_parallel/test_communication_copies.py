"""Tensor- and sequence-parallel communication without layout copies, recorded on t = 2 ranks:
every aten op a column-parallel then row-parallel pair (and the vocabulary-parallel embedding)
dispatches in forward and backward is logged between the collectives it calls, with the moment
each asynchronous collective is waited on. No copy (clone, copy_, cat, dtype cast) comes right
before or after a collective, the gathers fill one flat tensor (all_gather_into_tensor, no
list and cat), the all-reduces sum in place, and the backward computes the weight's gradient
while the input gradient's collective runs. Under --sequence-parallel a rank's part of the
[b, s, h] sequence is contiguous for micro-batch 1 only; for b > 1 one copy stays beside each
gather and reduce-scatter (checked too, so that the claim stays exact)."""
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_2bw.tensor_parallel import layers, mappings
from megatron_2bw.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                 VocabParallelEmbedding, initialize_parameters)
from tests.distributed_helpers import run_ranks

HIDDEN, FFN, SEQ, VOCAB = 8, 12, 6, 16
COPIES = {"aten.clone.default", "aten.copy_.default", "aten.cat.default",
          "aten._to_copy.default"}
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class _Handle:
    def __init__(self, work, name, recorder):
        self.work, self.name, self.recorder = work, name, recorder

    def wait(self):
        self.recorder.log.append(("wait", self.name))
        with self.recorder.backend():
            return self.work.wait()


class Recorder(TorchDispatchMode):
    """aten ops and the collectives mappings and layers call, in order."""

    def __init__(self, monkeypatch_targets):
        super().__init__()
        self.log, self.targets, self.saved = [], monkeypatch_targets, []
        self.inside = False

    @contextmanager
    def backend(self):
        """Ops a backend runs inside a collective (gloo's reduce-scatter is an all-reduce and a
        copy of this rank's part): the backend's, not the caller's."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def __enter__(self):
        for module in self.targets:
            for name in COLLECTIVES:
                if hasattr(module, name):
                    self.saved.append((module, name, getattr(module, name)))
                    setattr(module, name, self._wrap(name, getattr(module, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for module, name, original in self.saved:
            setattr(module, name, original)
        return super().__exit__(*exc)

    def _wrap(self, name, collective):
        def recorded(*args, async_op=False, **kwargs):
            self.log.append(("collective", name))
            with self.backend():
                work = collective(*args, async_op=async_op, **kwargs)
            return _Handle(work, name, self) if async_op and work is not None else work
        return recorded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not str(func).startswith("c10d"):
            self.log.append(("backend" if self.inside else "op", str(func)))
        return func(*args, **(kwargs or {}))


# ops that move no data (views, allocations), looked through to the op next to a collective
NO_DATA = ("view", "transpose", "permute", "aten.t.", "new_empty", "aten.empty", "detach",
           "unsqueeze", "split", "alias", "expand", "slice", "select")


def copies_next_to_collectives(log) -> list:
    """(collective, copy) for each copy that is the first data-moving op before or after a
    collective, or after the wait on it."""
    ops = [(i, name) for i, (kind, name) in enumerate(log)
           if kind == "op" and not any(word in name for word in NO_DATA)]
    found = []
    for i, (kind, name) in enumerate(log):
        if kind not in ("collective", "wait"):
            continue
        before = [op for j, op in ops if j < i][-1:] if kind == "collective" else []
        after = [op for j, op in ops if j > i][:1]
        found += [(name, op) for op in before + after if op in COPIES]
    return found


def _pair(rank, world, batch, sequence_parallel):
    torch.manual_seed(0)
    group = dist.new_group(list(range(world)))
    fc1 = ColumnParallelLinear(HIDDEN, FFN, group, sequence_parallel=sequence_parallel)
    fc2 = RowParallelLinear(FFN, HIDDEN, group, sequence_parallel=sequence_parallel)
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, group, sequence_parallel=sequence_parallel)
    for module in (fc1, fc2, embedding):
        initialize_parameters(module, seed=3, std=0.5, num_layers=2)
    seq = SEQ // world if sequence_parallel else SEQ
    x = torch.randn(batch, seq, HIDDEN, requires_grad=True)
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    recorder = Recorder([mappings, layers])
    with recorder:
        y = fc2(F.gelu(fc1(x)))
        y.backward(torch.ones_like(y))
        embedding(ids)
    return recorder.log


def _overlapped(log, name) -> bool:
    """The input gradient's collective starts, a matmul (the weight's gradient) runs, then it is
    waited on."""
    for i, entry in enumerate(log):
        if entry == ("collective", name):
            rest = log[i + 1:]
            if ("wait", name) in rest:
                waited = rest.index(("wait", name))
                if any(op == "aten.mm.default" for _, op in rest[:waited]):
                    return True
    return False


def _check(rank, world, batch, sequence_parallel):
    log = _pair(rank, world, batch, sequence_parallel)
    collectives = [name for kind, name in log if kind == "collective"]
    return collectives, copies_next_to_collectives(log), \
        _overlapped(log, "reduce_scatter_tensor" if sequence_parallel else "all_reduce")


def test_sequence_parallel_micro_batch_1_collectives_have_no_copies_and_overlap():
    for collectives, copies, overlapped in run_ranks(2, _check, 1, True):
        # forward: gather, reduce-scatter, the embedding's reduce-scatter; backward: the
        # row-parallel's gather, the column-parallel's gather and reduce-scatter
        assert sorted(set(collectives)) == ["all_gather_into_tensor", "reduce_scatter_tensor"]
        assert collectives.count("all_gather_into_tensor") == 3
        assert copies == []
        assert overlapped


def test_tensor_parallel_all_reduces_sum_in_place_and_overlap():
    for collectives, copies, overlapped in run_ranks(2, _check, 2, False):
        assert collectives == ["all_reduce"] * 3  # forward: fc2, the embedding; fc1's gradient
        assert copies == []
        assert overlapped


def test_sequence_parallel_micro_batch_2_keeps_one_layout_copy_per_collective():
    """[b, s, h] with b > 1: a rank's part of the sequence is not contiguous, so each gather and
    reduce-scatter has one copy beside it (the sequence-first layout would remove them)."""
    for collectives, copies, overlapped in run_ranks(2, _check, 2, True):
        assert {name for name, _ in copies} == {"all_gather_into_tensor",
                                                "reduce_scatter_tensor"}
        assert {op for _, op in copies} == {"aten.clone.default"}
        assert overlapped


def _under_autocast(rank, world, sequence_parallel):
    """The column-parallel layer's autograd function runs its backward under the forward's
    autocast (GLUE fine-tuning's bf16): gradients as torch's F.linear gives them."""
    torch.manual_seed(0)
    group = dist.new_group(list(range(world)))
    layer = ColumnParallelLinear(HIDDEN, FFN, group, sequence_parallel=sequence_parallel)
    initialize_parameters(layer, seed=3, std=0.5, num_layers=2)
    x = torch.randn(2, SEQ, HIDDEN)
    part = x[:, rank * SEQ // world:(rank + 1) * SEQ // world] if sequence_parallel else x
    mine = part.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(mine)
    (y.float() ** 2).sum().backward()
    whole = x.clone().requires_grad_()
    weight = layer.weight.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = F.linear(whole, weight, layer.bias.detach())
    (reference.float() ** 2).sum().backward()
    grad_input = whole.grad.clone()
    dist.all_reduce(grad_input, group=group)
    if sequence_parallel:
        grad_input = grad_input[:, rank * SEQ // world:(rank + 1) * SEQ // world]
    assert y.dtype == torch.bfloat16 and mine.grad.dtype == torch.float32
    torch.testing.assert_close(y, reference)
    torch.testing.assert_close(mine.grad, grad_input, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(layer.weight.grad, weight.grad, atol=1e-2, rtol=1e-2)
    return True


def test_column_parallel_backward_under_autocast():
    for sequence_parallel in (False, True):
        assert all(run_ranks(2, _under_autocast, sequence_parallel))
