"""The planner's Muon: its step adds each layer's whole-matrix Newton-Schulz (modelled FLOPs) and,
at t > 1 or with the distributed optimizer, the gathers of the matrices' updates."""
import pytest

from megatron_2bw.config import ParallelConfig, PrecisionConfig
from megatron_2bw.planner.cost import Candidate, newton_schulz_flops, stage_costs
from megatron_2bw.planner.memory import layer_matrix_shapes
from tests.planner.test_cost import COSTS, MODEL, toy_hardware


def test_newton_schulz_flops_count_three_products_per_step():
    # 64 x 256 (the smaller side first): X X^T 2*64*64*256, its square 2*64^3, times X 2*64*64*256
    assert newton_schulz_flops((256, 64), steps=1) == 2 * 64 * 64 * 256 * 2 + 2 * 64 ** 3
    assert newton_schulz_flops((64, 256)) == 5 * newton_schulz_flops((256, 64), steps=1)


def test_a_muon_step_adds_the_orthogonalisation_of_each_layers_matrices():
    hw = toy_hardware(devices_per_node=8, nodes=1)
    h, f = MODEL.hidden_size, MODEL.ffn_hidden_size
    assert sorted(layer_matrix_shapes(MODEL)) == sorted([(3 * h, h), (h, h), (f, h), (h, f)])
    per_layer = sum(newton_schulz_flops(shape) for shape in layer_matrix_shapes(MODEL)) / 1e12
    candidate = Candidate(1, 2, 1, 1, None, "2bw", layer_split=(1, 3))
    adam = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "adam")
    muon = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "muon")
    for layers, a, m in zip((1, 3), adam, muon):
        assert m.step_s - a.step_s == pytest.approx(layers * per_layer)
        assert m.step_comm_s == a.step_comm_s == 0
    for tensor, data, sharded in ((2, 1, False), (1, 2, True)):
        candidate = Candidate(tensor, 2, data, 1, None, "2bw", layer_split=(1, 3))
        parallel = ParallelConfig(use_distributed_optimizer=sharded)
        adam = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "adam", parallel)
        muon = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "muon", parallel)
        assert all(m.step_comm_s > a.step_comm_s for a, m in zip(adam, muon))
