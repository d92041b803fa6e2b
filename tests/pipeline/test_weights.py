"""WeightVersions' gradient buffer: after a batch, take_gradients leaves the batch's gradients in
the master gradients and a zeroed buffer; fp32 2BW trades the two storages instead of copying."""
import pytest
import torch
from torch import nn

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
    (torch.bfloat16, torch.float32, False),  # bf16 weights, fp32 accumulation: a copy
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
