"""WeightVersions: after a batch, take_gradients leaves the batch's gradients in the master
gradients and a zeroed buffer (an fp32 buffer trades storage with them instead of copying; one
version: the master gradients are the buffer, bf16 included); in fp32 2BW
the master weights are the newest version's working copy, and a step never writes a version in
use."""
import pytest
import torch
from torch import nn

from megatron_2bw.memory import storage_bytes
from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.weights import WeightVersions
from megatron_2bw.tensor_parallel.layers import initialize_parameters, replicated_param


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = replicated_param((3, 4), "normal")
        self.bias = replicated_param((3,), "normal")
        initialize_parameters(self, seed=5, std=0.5, num_layers=1)

    def forward(self, x):
        return (x @ self.weight.t() + self.bias).tanh().square().sum()


def expected_gradients(module: Tiny, batch: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of the batch's loss, by autograd on a plain fp32 copy of the module."""
    plain = Tiny()
    plain.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    plain(batch.float()).backward()
    return [plain.weight.grad, plain.bias.grad]


@pytest.mark.parametrize("working, grads, swaps", [
    (torch.float32, torch.float32, True),  # fp32 2BW
    (torch.bfloat16, torch.float32, True),  # bf16 weights, fp32 accumulation: traded too
    (torch.bfloat16, torch.bfloat16, False),  # bf16 gradients into fp32 masters: a cast copy
])
def test_take_gradients_leaves_each_batch_in_the_master_and_a_zeroed_buffer(working, grads, swaps):
    module = Tiny()
    versions = WeightVersions(module, working, grads, single_version=False)
    assert versions.swaps_gradients == swaps
    storages = set()
    for batch_index in range(3):
        batch = torch.randn(2, 4, generator=torch.Generator().manual_seed(batch_index))
        expected = expected_gradients(module, batch.to(working))
        module(batch.to(working)).backward()
        buffer = versions.main_grad_buffer
        storages.add(buffer.untyped_storage().data_ptr())
        versions.take_gradients()
        tolerance = 1e-6 if grads == torch.float32 and working == torch.float32 else 2e-2
        for master, want in zip(versions.master, expected):
            torch.testing.assert_close(master.grad, want, atol=tolerance, rtol=tolerance)
        assert not versions.main_grad_buffer.any()
        # the master gradients view the buffer the batch accumulated into iff they trade
        traded = versions.master[0].grad.untyped_storage().data_ptr() == \
            buffer.untyped_storage().data_ptr()
        assert traded == swaps
    # trading alternates between two storages; copying keeps one buffer
    assert len(storages) == (2 if swaps else 1)


@pytest.mark.parametrize("working", [torch.float32, torch.bfloat16, torch.float16])
def test_one_version_with_an_fp32_buffer_steps_on_the_buffer_itself(working):
    """Flush/GPipe: no backward runs between a batch's reduction and its step, so the master
    gradients are the accumulation buffer (no second fp32 gradient tensor, no copy)."""
    module = Tiny()
    versions = WeightVersions(module, working, torch.float32, single_version=True)
    assert versions.shared_grads and not versions.swaps_gradients
    buffer = versions.main_grad_buffer
    batch = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    expected = expected_gradients(module, batch.to(working))
    module(batch.to(working)).backward()
    versions.take_gradients()
    for master, want in zip(versions.master, expected):
        assert _storage(master.grad) == _storage(buffer)
        torch.testing.assert_close(master.grad, want, atol=2e-2, rtol=2e-2)
    fp32_grads = [t for t in versions.tensors() if t.dtype == torch.float32 and
                  _storage(t) not in {_storage(m) for m in versions.master_regions}]
    assert storage_bytes(fp32_grads) == 4 * versions.layout.total  # the buffer alone


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("working, follows", [(torch.float32, True), (torch.bfloat16, False)])
def test_fp32_2bw_holds_two_weight_copies_the_master_weights_being_the_newest(working, follows):
    versions = WeightVersions(Tiny(), working, torch.float32, single_version=False)
    assert versions.master_follows_newest == follows
    numel, e = versions.layout.total, torch.finfo(working).bits // 8
    weights = storage_bytes(versions.master_regions + [c.flat for c in versions.working_copies()])
    # two working copies; a third, fp32, copy only where the working precision differs
    assert weights == 2 * e * numel + (0 if follows else 4 * numel)
    newest = versions.versions[versions.newest].flat
    assert (_storage(versions.master[0]) == _storage(newest)) == follows


@pytest.mark.parametrize("stage, copies", [(0, 6), (1, 1)])
def test_a_2bw_step_writes_a_free_copy_and_copies_only_while_its_version_is_in_use(stage, copies):
    """The schedule's actions of one stage (p = 2, m = 2, 6 batches) drive the versions; each step
    stands in for the optimizer by adding 1 to the master weights. The first stage steps while the
    newest version is still in use (a copy first); the last steps right after releasing it (in
    place), except in the drain, whose last step follows no release."""
    versions = WeightVersions(Tiny(), torch.float32, torch.float32, single_version=False)
    values = {0: [m.detach().clone() for m in versions.master]}
    copied = 0
    for action in S.stage_actions("2bw", 2, 2, 6, stage):
        if action.kind in S.COMPUTE_KINDS:
            versions.install(action.version)
            for leaf, want in zip(versions.versions[action.version], values[action.version]):
                assert torch.equal(leaf, want)  # no step has written a version in use
        elif action.kind == S.RELEASE_VERSION:
            versions.release(action.version)
        elif action.kind == S.STEP:
            before = versions._master_copy
            versions.prepare_step()
            copied += versions._master_copy is not before
            master = _storage(versions.master[0])
            assert all(_storage(c.flat) != master for c in versions.versions.values())
            with torch.no_grad():
                for m in versions.master:
                    m.add_(1.0)
            versions.create(action.version)
            values[action.version] = [w + 1.0 for w in values[action.version - 1]]
            assert _storage(versions.versions[action.version].flat) == master
            assert versions.distinct_versions + len(versions._free) == 2  # never a third copy
    assert copied == copies
