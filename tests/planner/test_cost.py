import dataclasses
import math

import pytest

from megatron_2bw.config import ModelConfig, ParallelConfig, PrecisionConfig
from megatron_2bw.planner.cost import (Candidate, Network, core_sharing, StageCost, balanced_layer_split,
                                       paper_time_per_batch, piece_times, stage_costs)
from megatron_2bw.planner.hardware import HardwareSpec
from megatron_2bw.planner.memory import stage_parameters, stage_tensor_partial_grad_parameters
from megatron_2bw.planner.profile import ComputeCosts


# a 2-layer model with round piece times (ms): forward 4 per layer, backward 8, head 3 and 6
SMALL_MODEL = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                          vocab_size=16)
SMALL_COSTS = ComputeCosts(layer_forward_s=0.004, layer_backward_s=0.008,
                           attention_core_forward_s=0.001, embedding_forward_s=0.001,
                           embedding_backward_s=0.001, head_forward_s=0.003, head_backward_s=0.006,
                           layer_activation_bytes=1.0, selective_layer_activation_bytes=1.0)


def toy_hardware(devices_per_node=4, nodes=2) -> HardwareSpec:
    """Round numbers: 100 B/s and 1 s inside a node, 10 B/s per node and 5 s between nodes."""
    return HardwareSpec(name="toy", devices_per_node=devices_per_node, nodes=nodes,
                        memory_per_device_bytes=1e12, intra_node_bandwidth=100.0,
                        intra_node_latency_s=1.0, inter_node_bandwidth=10.0,
                        inter_node_latency_s=5.0, peak_flops={"float32": 1e12},
                        memory_bandwidth=1e12, efficiency=1.0)


def test_ring_allreduce_inside_a_node():
    net = Network(toy_hardware(), tensor=4, pipeline=2, data=1)
    # 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency
    assert net.allreduce_time("tensor", 1000) == pytest.approx(2 * 3 / 4 * 1000 / 100 + 6 * 1.0)


def test_ring_allreduce_across_nodes_is_paced_by_the_shared_link():
    one_ring = Network(toy_hardware(), tensor=1, pipeline=1, data=8)
    # ranks 0..7 on two nodes: the ring leaves each node once
    assert one_ring.allreduce_time("data", 1000, stage=0) == \
        pytest.approx(2 * 7 / 8 * 1000 / 10 + 14 * 5.0)
    # t = 2: two data-parallel rings (even and odd ranks) share each node's link
    two_rings = Network(toy_hardware(), tensor=2, pipeline=1, data=4)
    assert two_rings.allreduce_time("data", 1000, stage=0) == \
        pytest.approx(2 * 3 / 4 * 1000 * 2 / 10 + 6 * 5.0)
    assert two_rings.allreduce_time("data", 1000, stage=0, buckets=3) == \
        pytest.approx(2 * 3 / 4 * 1000 * 2 / 10 + 3 * 6 * 5.0)
    assert Network(toy_hardware(), 1, 8, 1).allreduce_time("data", 1000, stage=0) == 0.0


def test_pipeline_transfers_share_the_node_link():
    # a stage per node: its 4 replicas all send to the next node at once
    across = Network(toy_hardware(), tensor=1, pipeline=2, data=4)
    assert across.transfer_time(0, 1, 1000) == pytest.approx(5.0 + 1000 * 4 / 10)
    inside = Network(toy_hardware(devices_per_node=8, nodes=1), tensor=1, pipeline=2, data=4)
    assert inside.transfer_time(1, 0, 1000) == pytest.approx(1.0 + 1000 / 100)


def test_tensor_parallel_must_stay_inside_a_node():
    with pytest.raises(ValueError, match="must divide the 4 devices"):
        Network(toy_hardware(), tensor=8, pipeline=1, data=1)


COSTS = ComputeCosts(layer_forward_s=1.0, layer_backward_s=2.0, attention_core_forward_s=0.25,
                     embedding_forward_s=0.1, embedding_backward_s=0.2, head_forward_s=0.5,
                     head_backward_s=1.0, layer_activation_bytes=0.0,
                     selective_layer_activation_bytes=0.0)
MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=1000)


def costs_of(recompute=None, schedule="flush", tensor=1):
    hw = toy_hardware(devices_per_node=8, nodes=1)
    candidate = Candidate(tensor, 2, 1, 1, recompute, schedule, layer_split=(1, 3))
    return stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "adam")


def test_every_stage_takes_the_profiles_turn_taking_overhead():
    hw = toy_hardware(devices_per_node=8, nodes=1)
    costs = dataclasses.replace(COSTS, turn_taking_overhead=0.15)
    candidate = Candidate(1, 2, 1, 1, None, "2bw", layer_split=(1, 3))
    assert [stage.turn_overhead for stage in stage_costs(
        MODEL, hw, costs, candidate, PrecisionConfig(), "adam")] == [0.15, 0.15]


def test_stage_durations_add_up_the_pieces():
    first, last = costs_of()
    assert (first.forward_s, first.backward_s) == pytest.approx((1.0 + 0.1, 2.0 + 0.2))
    assert (last.forward_s, last.backward_s) == pytest.approx((3 * 1.0 + 0.5, 3 * 2.0 + 1.0))
    activation = 32 * 64 * 4  # b s h fp32
    assert first.send_act_s == pytest.approx(1.0 + activation / 100) == last.send_grad_s
    assert first.send_grad_s == 0.0 == last.send_act_s
    # fp32 flush: the master weights are the working weights, so reduce = the grad-norm pass
    # (d = 1: no all-reduce) and the step = Adam + unscaling, all at memory bandwidth
    # The first stage's step also waits for the all-reduce of the tied word embeddings' fp32
    # gradient with the last stage; every step waits for the grad-norm all-reduce (4 bytes, 2 ranks).
    P = stage_parameters(MODEL, 1, 1, True, False)
    tied = 2 * 1 / 2 * (4 * 1024 * 64) / 100 + 2 * 1.0
    assert first.reduce_s == pytest.approx(12 * P / 1e12)
    assert first.tied_async_s == pytest.approx(tied) and last.tied_async_s == 0.0
    assert last.reduce_s == pytest.approx(12 * stage_parameters(MODEL, 1, 3, False, True) / 1e12)
    assert first.step_s == pytest.approx((28 + 8) * P / 1e12)
    assert first.reduce_async_s == last.reduce_async_s == pytest.approx(2 * 1 / 2 * 4 / 100 + 2)


def test_an_untied_output_layer_has_no_embedding_all_reduce():
    hw = toy_hardware(devices_per_node=8, nodes=1)
    candidate = Candidate(1, 2, 1, 1, None, "flush", layer_split=(1, 3))
    untied = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         vocab_size=1000, untie_embeddings_and_output_weights=True)
    first, last = stage_costs(untied, hw, COSTS, candidate, PrecisionConfig(), "adam")
    assert first.tied_async_s == 0.0 == last.tied_async_s
    assert costs_of()[0].tied_async_s > 0.0


def test_the_data_parallel_reduction_runs_on_after_reduce():
    """pipeline/update.py leaves the all-reduce of the gradient buffer (the distributed
    optimizer's reduce-scatter, half its ring traffic) running after reduce; reduce itself is
    the local work."""
    def last_stage(distributed_optimizer):
        candidate = Candidate(1, 2, 2, 1, None, "2bw", layer_split=(1, 3))
        return stage_costs(MODEL, toy_hardware(devices_per_node=8, nodes=1), COSTS, candidate,
                           PrecisionConfig(), "adam",
                           ParallelConfig(use_distributed_optimizer=distributed_optimizer))[1]
    P = stage_parameters(MODEL, 1, 3, False, True)
    average = 2 * 1 / 2 * 4 * P / 100 + 2 * 1.0  # fp32 gradients, a ring of 2, one bucket
    # fp32 2BW, unsharded: the buffer and the master gradients trade storage, and the buffer is
    # zeroed; sharded: copied into the master gradients, then zeroed; both: the norm's pass
    local = {False: (4 + 12) * P / 1e12, True: (2 * 4 + 4 + 12) * P / 1e12}
    for sharded in (False, True):
        stage = last_stage(sharded)
        assert stage.reduce_background_s == pytest.approx(average / 2 if sharded else average)
        assert stage.reduce_s == pytest.approx(local[sharded])


def test_the_overlapped_data_parallel_reduction_leaves_what_outlasts_the_last_backward():
    """On GPUs the runtime starts each bucket's reduction during the batch's last backward
    (pipeline/overlap.py): what is left after it is the reduction less that backward, at least
    the last bucket's; with --no-overlap-grad-reduce, or on CPU ranks by default, all of it."""
    candidate = Candidate(1, 2, 2, 1, None, "flush", layer_split=(1, 3))
    slow = dataclasses.replace(COSTS, layer_backward_s=1.0)  # 3 layers: 3 s of backward

    def last_stage(device, overlap=None, buckets=40_000_000):
        hardware = dataclasses.replace(toy_hardware(devices_per_node=8, nodes=1),
                                       device_type=device)
        return stage_costs(MODEL, hardware, slow, candidate, PrecisionConfig(), "adam",
                           ParallelConfig(overlap_grad_reduce=overlap,
                                          ddp_bucket_size=buckets))[1]
    buckets = math.ceil(stage_parameters(MODEL, 1, 3, False, True) / 1000)
    whole = last_stage("cpu", buckets=1000).reduce_background_s
    assert last_stage("cuda", False, 1000).reduce_background_s == pytest.approx(whole)
    backward = last_stage("cuda").backward_s
    assert whole - backward > whole / buckets
    assert last_stage("cuda", buckets=1000).reduce_background_s == pytest.approx(whole - backward)
    assert last_stage("cpu", True, 1000).reduce_background_s == pytest.approx(whole - backward)
    # one bucket waits for the whole backward: nothing overlaps
    assert last_stage("cuda").reduce_background_s == pytest.approx(
        last_stage("cpu").reduce_background_s)
    # a backward longer than the reduction leaves the last bucket's
    long = dataclasses.replace(slow, layer_backward_s=1e5)
    hardware = toy_hardware(devices_per_node=8, nodes=1)
    stage = stage_costs(MODEL, hardware, long, candidate, PrecisionConfig(), "adam",
                        ParallelConfig(ddp_bucket_size=1000))[1]
    assert stage.reduce_background_s == pytest.approx(whole / buckets)


def test_fp32_2bw_writes_a_new_version_by_copy_except_on_the_last_stage():
    """The master weights are the newest version (WeightVersions.prepare_step): the first stage
    copies it into the free copy before each step (8 bytes a parameter); the last stage steps
    right after releasing the older version and updates that copy in place; in bf16 every stage
    writes the new version from the fp32 master weights (4 + 2 bytes)."""
    hw = toy_hardware(devices_per_node=8, nodes=1)
    candidate = Candidate(1, 2, 1, 1, None, "2bw", layer_split=(1, 3))
    P = [stage_parameters(MODEL, 1, 1, True, False), stage_parameters(MODEL, 1, 3, False, True)]
    adam = (28 + 8) / 1e12
    first, last = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "adam")
    assert first.step_s == pytest.approx((adam + 8 / 1e12) * P[0])
    assert last.step_s == pytest.approx(adam * P[1])
    first, last = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(bf16=True), "adam")
    assert (first.step_s, last.step_s) == pytest.approx([(adam + 6 / 1e12) * n for n in P])


def test_sharded_fp32_2bw_copies_only_its_part_of_the_newest_version():
    """With the distributed optimizer over d = 2 the master weights are this rank's half of the
    newest version: the first stage copies that half (8 bytes a parameter / 2) before its step,
    the last stage none; each steps its half and all-gathers the rest, in the background (the
    version is first read a batch later), where Flush's next forward waits for it."""
    hw = toy_hardware(devices_per_node=8, nodes=1)
    candidate = Candidate(1, 2, 2, 1, None, "2bw", layer_split=(1, 3))
    P = [stage_parameters(MODEL, 1, 1, True, False), stage_parameters(MODEL, 1, 3, False, True)]
    first, last = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "adam",
                              ParallelConfig(use_distributed_optimizer=True))
    adam = (28 + 8) / 1e12
    assert first.step_s - first.step_comm_s == pytest.approx((adam + 8 / 1e12) * P[0] / 2)
    assert last.step_s - last.step_comm_s == pytest.approx(adam * P[1] / 2)
    assert first.step_comm_s == 0 and last.step_comm_s == 0
    flush = stage_costs(MODEL, hw, COSTS, Candidate(1, 2, 2, 1, None, "flush", layer_split=(1, 3)),
                        PrecisionConfig(), "adam", ParallelConfig(use_distributed_optimizer=True))
    assert all(stage.step_comm_s > 0 for stage in flush)


def test_recomputation_adds_a_forward_and_tensor_parallelism_adds_all_reduces():
    plain, full, selective = costs_of()[1], costs_of("full")[1], costs_of("selective")[1]
    assert full.backward_s - plain.backward_s == pytest.approx(3 * 1.0)
    assert selective.backward_s - plain.backward_s == pytest.approx(3 * 0.25)
    two = costs_of(tensor=2)[1]  # same ComputeCosts: only the communication differs
    allreduce = 2 * 1 / 2 * 32 * 64 * 4 / 100 + 2 * 1.0
    loss_allreduce = 2 * 1 / 2 * 4 * 32 / 100 + 2 * 1.0
    assert two.forward_s - plain.forward_s == pytest.approx(3 * 2 * allreduce + 3 * loss_allreduce)
    assert two.backward_s - plain.backward_s == pytest.approx(3 * 2 * allreduce + allreduce)


def test_sequence_parallel_halves_the_messages_and_splits_the_embeddings_all_reduce():
    """t = 2 with --sequence-parallel: a pipeline message is s/2 tokens; a layer's all-gathers
    and reduce-scatters cost its all-reduces (the same ring bytes); the embedding's all-reduce
    becomes a reduce-scatter forward and an all-gather backward (half each), the head gathers the
    sequence first (half), and each reduce sums the norms', biases' and positions' gradients
    over the tensor group."""
    sp = dataclasses.replace(MODEL, sequence_parallel=True)
    hw = toy_hardware(devices_per_node=8, nodes=1)
    candidate = Candidate(2, 2, 1, 1, None, "flush", layer_split=(1, 3))
    first, last = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "adam")
    split_first, split_last = stage_costs(sp, hw, COSTS, candidate, PrecisionConfig(), "adam")
    activation = 32 * 64 * 4  # b s h fp32
    assert split_first.send_act_s == pytest.approx(1.0 + activation / 2 / 100)
    assert split_last.send_grad_s == split_first.send_act_s
    assert first.send_act_s == pytest.approx(1.0 + activation / 100)
    allreduce = 2 * 1 / 2 * activation / 100 + 2 * 1.0
    assert split_first.forward_s == pytest.approx(first.forward_s - allreduce / 2)
    assert split_first.backward_s == pytest.approx(first.backward_s + allreduce / 2)
    assert split_first.backward_comm_s == pytest.approx(first.backward_comm_s + allreduce / 2)
    assert split_last.forward_s == pytest.approx(last.forward_s + allreduce / 2)
    assert split_last.backward_s == pytest.approx(last.backward_s)
    for plain, split, layers, first_stage, last_stage in ((first, split_first, 1, True, False),
                                                           (last, split_last, 3, False, True)):
        summed = 4 * stage_tensor_partial_grad_parameters(sp, 2, layers, first_stage, last_stage)
        assert summed > 0
        assert split.reduce_s - plain.reduce_s == pytest.approx(2 * 1 / 2 * summed / 100 + 2.0)
    # --sequence-parallel at t = 1 changes nothing
    single = Candidate(1, 2, 1, 1, None, "flush", layer_split=(1, 3))
    assert stage_costs(sp, hw, COSTS, single, PrecisionConfig(), "adam") == \
        stage_costs(MODEL, hw, COSTS, single, PrecisionConfig(), "adam")


def test_qk_layernorm_gradients_are_summed_over_the_tensor_group_each_batch():
    """Each rank applies the q/k norms to its own heads: at t = 2 (with or without
    --sequence-parallel) each reduce first all-reduces their fp32 gradients, two LayerNorms'
    weights and biases over the head size per layer; nothing at t = 1."""
    qk = dataclasses.replace(MODEL, qk_layernorm=True)
    hw = toy_hardware(devices_per_node=8, nodes=1)
    for t in (1, 2):
        candidate = Candidate(t, 2, 1, 1, None, "flush", layer_split=(1, 3))
        plain = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "adam")
        normed = stage_costs(qk, hw, COSTS, candidate, PrecisionConfig(), "adam")
        for layers, before, after in zip((1, 3), plain, normed):
            summed = 4 * layers * 4 * 16
            allreduce = 2 * 1 / 2 * summed / 100 + 2.0 if t == 2 else 0.0
            # (the norms' 64 parameters a layer move and zero in no time at 1 TB/s)
            assert after.reduce_s - before.reduce_s == pytest.approx(allreduce, abs=1e-6)


def test_every_pipeline_message_costs_its_processor_time():
    hw = dataclasses.replace(toy_hardware(devices_per_node=8, nodes=1), p2p_processor_s=0.01)
    candidate = Candidate(1, 4, 1, 1, None, "2bw", layer_split=(1, 1, 1, 1))
    charged = stage_costs(MODEL, hw, COSTS, candidate, PrecisionConfig(), "adam")
    plain = stage_costs(MODEL, dataclasses.replace(hw, p2p_processor_s=0.0), COSTS, candidate,
                        PrecisionConfig(), "adam")
    # the ends receive or send once per pass, the middle stages both
    for stage, messages in zip(range(4), (1, 2, 2, 1)):
        for field in ("forward_s", "backward_s"):
            extra = getattr(charged[stage], field) - getattr(plain[stage], field)
            assert extra == pytest.approx(0.01 * messages)
        assert charged[stage].forward_comm_s == plain[stage].forward_comm_s  # needs a processor
    one_stage = Candidate(1, 1, 1, 1, None, "flush")
    assert stage_costs(MODEL, hw, COSTS, one_stage, PrecisionConfig(), "adam") == \
        stage_costs(MODEL, dataclasses.replace(hw, p2p_processor_s=0.0), COSTS, one_stage,
                    PrecisionConfig(), "adam")


def test_balanced_split_moves_layers_off_the_head_stage():
    # 8 layers of 1 s, the head costs 2 s: the even split's last stage takes 4 s
    assert balanced_layer_split(8, 4, 1.0, 0.0, 2.0) == (2, 2, 3, 1)
    split = balanced_layer_split(32, 8, 1.0, 0.2, 1.8)
    times = [n + extra for n, extra in zip(split, [0.2] + [0] * 6 + [1.8])]
    assert sum(split) == 32 and min(split) >= 1 and max(times) == 5.0  # the best possible
    assert balanced_layer_split(5, 1, 1.0, 9.0, 9.0) == (5,)


def test_paper_closed_form():
    stage = StageCost(1.0, 2.0, 0.0, 0.0, 5.0, 0.0, 1.0)
    stages = [stage] * 4
    assert paper_time_per_batch(stages, "2bw", 8) == 24.0  # data-parallel work overlapped
    assert paper_time_per_batch(stages, "flush", 8) == (8 + 3) * 3.0 + 6.0
    assert paper_time_per_batch(stages, "gpipe", 8) == (8 + 3) * 3.0 + 6.0
    assert paper_time_per_batch([StageCost(1.0, 2.0, 0.0, 0.0, 50.0, 0.0, 1.0)] * 4, "2bw", 8) == 51.0
    talking = [StageCost(1.0, 2.0, 0.5, 0.0, 0, 0, 0), StageCost(1.0, 2.0, 0.0, 0.5, 0, 0, 0)]
    assert paper_time_per_batch(talking, "2bw", 8) == 8 * (3.0 + 1.0)  # + activation + gradient


def test_ranks_sharing_cores_take_turns():
    # processor time per batch: m * (forward + backward - collectives) + reduce + step - collectives
    # = 2 * 3 + 1 = 7 and 2 * (5 - 1) + 1 = 9 (stage 1's backward waits 1 s in collectives)
    stages = [StageCost(1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 1.0),
              StageCost(2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 1.0, backward_comm_s=1.0)]
    assert [st.processor_time(2) for st in stages] == [7.0, 9.0]
    # taking turns slows the compute by its overhead, not the collectives' waits: 2 x 4 x 1.5 + 1
    taking_turns = dataclasses.replace(stages[1], turn_overhead=0.5)
    assert taking_turns.processor_time(2) == 9.0
    assert taking_turns.processor_time(2, taking_turns=True) == 2 * 4 * 1.5 + 1
    four_ranks = dataclasses.replace(toy_hardware(devices_per_node=4, nodes=1),
                                     compute_slots_per_node=2)
    # p = 2, d = 2 on one node of 2 cores: ranks 0, 1 run stage 0, ranks 2, 3 stage 1
    sharing = core_sharing(four_ranks, Candidate(1, 2, 2, 1, None, "2bw"))
    assert sharing.ranks == ((2, 2),) and sharing.slots == 2
    assert sharing.bound(stages, 2) == pytest.approx((2 * 7 + 2 * 9) / 2)
    assert sharing.crowded(0)
    assert sharing.bound([stages[0], taking_turns], 2) == pytest.approx((2 * 7 + 2 * 13) / 2)
    # as many cores as ranks (or GPUs: one per device): no turns to take
    assert core_sharing(toy_hardware(devices_per_node=4, nodes=1),
                        Candidate(1, 2, 2, 1, None, "2bw")) is None
    # two nodes of 2 ranks each on 1 core: the busier node (stage 1's ranks) decides
    two_nodes = dataclasses.replace(toy_hardware(devices_per_node=2, nodes=2),
                                    compute_slots_per_node=1)
    sharing = core_sharing(two_nodes, Candidate(1, 2, 2, 1, None, "2bw"))
    assert sharing.ranks == ((2, 0), (0, 2))
    assert sharing.bound(stages, 2) == pytest.approx(2 * 9)


def test_a_blocked_rank_waits_half_a_slice_where_ranks_outside_its_group_share_its_cores():
    four_on_two = dataclasses.replace(toy_hardware(devices_per_node=4, nodes=1),
                                      compute_slots_per_node=2, scheduler_slice_s=0.004,
                                      allreduce_times=((2, 1024, 0.001), (4, 1024, 0.003)))
    net = Network(four_on_two, 2, 2, 1)  # t = 2, p = 2: two tensor-parallel pairs
    assert net.wake_s(2) == pytest.approx(0.002) and net.wake_s(4) == 0.0  # 4: the whole node
    assert net.allreduce_time("tensor", 1024) == pytest.approx(0.001 + 0.002)
    assert net.allreduce_time("tensor", 1024, buckets=2) == pytest.approx(2 * (0.001 + 0.002))
    assert net.allreduce_time("model", 1024) == pytest.approx(0.003)  # t x p: the whole node
    plain = Network(dataclasses.replace(four_on_two, scheduler_slice_s=None), 2, 2, 1)
    assert net.transfer_time(0, 1, 1e6) == pytest.approx(plain.transfer_time(0, 1, 1e6) + 0.002)
    # a processor per rank (GPUs), or a slice never measured: no turns to wait for
    own = dataclasses.replace(four_on_two, compute_slots_per_node=None)
    assert Network(own, 2, 2, 1).wake_s(2) == 0.0 and plain.wake_s(2) == 0.0


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("recompute", [None, "full"])
def test_a_stage_counts_the_collectives_it_is_charged_for(sequence_parallel, recompute):
    """With every tensor-parallel all-reduce costing the same (latency only), a pass's collective
    time is its count of all-reduces times one (the replay cuts a pass into that many pieces and
    pays each one's wait for a peer's turn), on the embedding's and the head's stages too."""
    hw = dataclasses.replace(toy_hardware(devices_per_node=4, nodes=1), intra_node_bandwidth=1e30,
                             compute_slots_per_node=2, scheduler_slice_s=0.5)
    model = dataclasses.replace(MODEL, sequence_parallel=sequence_parallel)
    candidate = Candidate(2, 2, 1, 1, recompute, "2bw", layer_split=(1, 3))
    first, last = stage_costs(model, hw, COSTS, candidate, PrecisionConfig(), "adam")
    one = 2 * 1.0 + 0.25  # a 2-rank ring's latency, and half a slice waiting for a peer's turn
    for stage, layers in ((first, 1), (last, 3)):
        assert stage.wake_s == pytest.approx(0.25)
        assert stage.forward_comm_s == pytest.approx(stage.forward_collectives * one)
        assert stage.backward_comm_s == pytest.approx(stage.backward_collectives * one)
        assert stage.forward_collectives >= 2 * layers
    assert last.forward_collectives == first.forward_collectives + 2 * 2 + 3 - (
        0.0 if sequence_parallel else 1.0)  # 2 more layers, the loss's 3, the head's gather
    # t = 1: no collectives, no waits
    single = stage_costs(model, hw, COSTS, dataclasses.replace(candidate, tensor_parallel=1),
                         PrecisionConfig(), "adam")
    assert all(x.forward_collectives == x.backward_collectives == x.wake_s == 0 for x in single)


def test_measured_allreduce_times_replace_the_ring_formula_inside_a_node():
    measured = dataclasses.replace(toy_hardware(devices_per_node=4, nodes=1), allreduce_times=(
        (2, 100, 1.0), (2, 10_000, 3.0), (4, 100, 2.0)))
    assert measured.measured_allreduce_s(2, 1000) == pytest.approx(2.0)  # halfway in log bytes
    assert measured.measured_allreduce_s(2, 10) == 1.0  # below the table: the smallest time
    assert measured.measured_allreduce_s(2, 20_000) == pytest.approx(6.0)  # above: per byte
    assert measured.measured_allreduce_s(8, 100) is None
    net = Network(measured, tensor=2, pipeline=1, data=2)
    assert net.allreduce_time("tensor", 1000) == pytest.approx(2.0)
    assert net.allreduce_time("data", 1000, stage=0, buckets=10) == pytest.approx(10 * 1.0)
    assert measured.measured_allreduce_s(4, 1000) == pytest.approx(20.0)  # one point: per byte
    # a group size without measurements keeps the ring formula
    only_pairs = dataclasses.replace(measured, allreduce_times=((2, 100, 1.0),))
    formula = Network(toy_hardware(devices_per_node=4, nodes=1), tensor=4, pipeline=1, data=1)
    assert Network(only_pairs, tensor=4, pipeline=1, data=1).allreduce_time("tensor", 1000) == \
        pytest.approx(formula.allreduce_time("tensor", 1000))


def test_tensor_parallel_allreduces_pay_the_extra_of_meeting_after_compute():
    model, costs = SMALL_MODEL, SMALL_COSTS
    hardware = dataclasses.replace(
        toy_hardware(devices_per_node=2, nodes=1), allreduce_times=((2, 4, 1e-3),),
        allreduce_after_compute=((0.002, 2e-4), (0.004, 6e-4)))
    precision = PrecisionConfig()
    ar = 1e-3  # every size: the one measured point, scaled up per byte beyond 4 B
    activation = 1 * 4 * 8 * 4
    ar_layer = ar * activation / 4
    pieces = piece_times(model, Network(hardware, 2, 1, 1), costs, 1, None, precision)
    # a layer meets after each half of its pass: 2 ms forward, 4 ms backward
    assert pieces.layer_forward_comm_s == pytest.approx(2 * (ar_layer + 2e-4))
    assert pieces.layer_backward_comm_s == pytest.approx(2 * (ar_layer + 6e-4))
    assert pieces.embedding_forward_comm_s == pytest.approx(ar_layer + 1e-4)  # after 1 ms
    assert pieces.head_forward_comm_s == pytest.approx(3 * (ar * 16 / 4 + 1e-4))  # 1 ms each
    assert pieces.head_backward_comm_s == pytest.approx(ar_layer + 6e-4)  # 6 ms: the last point
    # nothing to meet with t = 1; nothing measured, nothing added
    alone = piece_times(model, Network(hardware, 1, 1, 2), costs, 1, None, precision)
    assert alone.layer_forward_s == costs.layer_forward_s and alone.layer_forward_comm_s == 0.0
    plain = dataclasses.replace(hardware, allreduce_after_compute=())
    assert piece_times(model, Network(plain, 2, 1, 1), costs, 1, None, precision) \
        .layer_forward_comm_s == pytest.approx(2 * ar_layer)


def test_collectives_processor_work_counts_in_the_node_budget_of_ranks_sharing_cores():
    """gloo reduces on the cores the ranks compute on: with four ranks on two cores, each
    all-reduce's measured processor seconds are added to the rank's processor time (the node's
    bound), not to its own timeline, and its waits (a scheduler slice here) are not."""
    model, costs = SMALL_MODEL, SMALL_COSTS
    hardware = dataclasses.replace(toy_hardware(devices_per_node=4, nodes=1),
                                   compute_slots_per_node=2, scheduler_slice_s=0.004,
                                   allreduce_times=((2, 4, 1e-3), (2, 1 << 20, 4e-3)))
    measured = dataclasses.replace(hardware, allreduce_processor_times=(
        (2, 4, 5e-4), (2, 1 << 20, 5e-4)))
    assert measured.allreduce_processor_s(2, 1000) == pytest.approx(5e-4)
    assert measured.allreduce_processor_s(4, 1000) == 0.0  # a group size not measured
    assert hardware.allreduce_processor_s(2, 1000) == 0.0  # nothing measured (hardware files)

    candidate = Candidate(2, 1, 2, 1, None, "flush")  # t = 2, d = 2: both collectives
    before = stage_costs(model, hardware, costs, candidate, PrecisionConfig(), "adam")[0]
    after = stage_costs(model, measured, costs, candidate, PrecisionConfig(), "adam")[0]
    # per microbatch: 2 layers x 4 (f and g, forward and backward), the embedding's 1, the
    # loss's 3 and the head's backward 1; per batch: the one bucket of gradients, the loss
    # sums over the replicas and the norm over the model group
    assert after.comm_processor_s == pytest.approx((2 * 4 + 1 + 3 + 1) * 5e-4)
    assert after.batch_comm_processor_s == pytest.approx(3 * 5e-4)
    m = 3
    assert after.processor_time(m) == pytest.approx(before.processor_time(m) + m * 13 * 5e-4
                                                    + 3 * 5e-4)
    assert (before.comm_processor_s, before.batch_comm_processor_s) == (0.0, 0.0)
    assert (after.forward_s, after.backward_s, after.reduce_s) == \
        (before.forward_s, before.backward_s, before.reduce_s)  # the rank's own timeline


def test_every_collective_of_the_batch_counts_its_processor_work():
    """Each batch a stage's ranks also sum the tied embedding's gradients (first and last stage,
    a group of two), the loss sums over the replicas (last stage) and the norm over the model
    group, besides the gradients' reduction: on ranks sharing cores each costs its measured
    processor seconds (here 0.5 ms in a group of two, 0.7 ms in one of four)."""
    model = dataclasses.replace(SMALL_MODEL, num_layers=4)
    hardware = dataclasses.replace(toy_hardware(devices_per_node=4, nodes=1),
                                   compute_slots_per_node=2, allreduce_processor_times=(
                                       (2, 4, 5e-4), (2, 1 << 30, 5e-4),
                                       (4, 4, 7e-4), (4, 1 << 30, 7e-4)))

    def batch_processor(t, p, d, untied=False):
        tied = dataclasses.replace(model, untie_embeddings_and_output_weights=untied)
        return [st.batch_comm_processor_s for st in stage_costs(
            tied, hardware, SMALL_COSTS, Candidate(t, p, d, 1, None, "2bw"), PrecisionConfig(),
            "adam")]

    ar2, ar4 = 5e-4, 7e-4
    # p = 2, d = 2: first stage gradients + tied + norm; last stage also the loss sums
    assert batch_processor(1, 2, 2) == pytest.approx([3 * ar2, 4 * ar2])
    assert batch_processor(1, 2, 2, untied=True) == pytest.approx([2 * ar2, 3 * ar2])
    # p = 4, d = 1: no replicas; the norm over four ranks everywhere, the tied sum at the ends
    assert batch_processor(1, 4, 1) == pytest.approx([ar4 + ar2, ar4, ar4, ar4 + ar2])
    # d = 4: the gradients and the loss sums over four ranks, no model group to sum over
    assert batch_processor(1, 1, 4) == pytest.approx([2 * ar4])
