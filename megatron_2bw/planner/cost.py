"""The cost model: durations of every schedule action of every stage for one parallel configuration,
and the PipeDream-2BW paper's closed-form time per batch.

Placement follows the runtime (distributed/layout.py): rank = pp*(d*t) + dp*t + tp, devices filled
node by node, so a tensor-parallel group sits inside a node (t must divide devices_per_node) and a
stage's replicas share a node when t*d <= devices_per_node.

Communication (hardware.py's link model):
- a transfer of n bytes takes latency + n / bandwidth; inside a node at intra_node_bandwidth, across
  nodes at inter_node_bandwidth divided by the flows that leave (or enter) the node at the same
  time: all pipeline replicas send their activations together, all data-parallel groups of a stage
  reduce together.
- an all-reduce is a ring over the group in rank order: 2(n-1)/n * n_bytes / (slowest hop) +
  2(n-1) * latency (per bucket for the bucketed data-parallel all-reduce); inside a node, the
  hardware's measured all-reduce times of that group size when it has them (detect_hardware).
Per microbatch, a stage's forward and backward include its tensor-parallel all-reduces (2 per layer
each way, Megatron's f/g, plus the embedding's and the head's), which block compute.
Under --sequence-parallel each of a layer's all-reduces becomes an all-gather of the sequence before
a column-parallel linear and a reduce-scatter after a row-parallel one (and the reverse in
backward). On a ring an all-gather and a reduce-scatter of the whole activation each move half an
all-reduce's bytes in half its steps, so the model charges a layer what it charges without
sequence parallelism (the same all-reduce time, measured or ring, and processor work): simple,
though twice as many collectives pay their fixed costs. The embedding's all-reduce becomes a
reduce-scatter (half an all-reduce) and an all-gather in its backward (the other half); the last
stage adds an all-gather of the sequence before the final norm (half an all-reduce); pipeline
messages hold s/t tokens; and each batch's reduce first sums the sequence-parallel parameters'
gradients (norms, row-parallel biases, position tables) over the tensor-parallel group, as it
does at any t > 1 for --qk-layernorm's norms (each rank normalises its own heads' q and k).
Recomputation adds a forward ("full": the layer with its all-reduces; "selective": the attention
core). On CPU ranks each pass also costs the processor time of its pipeline messages (a receive
from one neighbour, a send to the other: `HardwareSpec.p2p_processor_s`, measured by
detect_hardware).
Per batch (pipeline/update.py): `reduce` blocks for the data-parallel all-reduce of the stage's
gradient buffer and the move into the fp32 master gradients; the tied-embedding all-reduce between
the first and last stage and the grad-norm all-reduce over the model group run in the background
until `step` (the first stage adds its part of the norm at its step, once the tied sum is there, so
every other stage's step also waits for the first stage to reach its step), which then runs the
optimizer (memory-bound) and writes the new weight version.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from megatron_2bw.config import ModelConfig, ParallelConfig, PrecisionConfig
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.pipeline.partition import layer_ranges
from megatron_2bw.pipeline.schedules import NEVER_DRAINED, live_versions
from megatron_2bw.planner.hardware import HardwareSpec
from megatron_2bw.planner.memory import (dtype_bytes, grad_buffer_bytes, layer_matrix_shapes,
                                         stage_hidden_matrix_parameters, stage_parameters,
                                         stage_tensor_partial_grad_parameters)
from megatron_2bw.planner.profile import ComputeCosts
from megatron_2bw.planner.stage_plan import LayerCosts

RECOMPUTE_OPTIONS = (None, "selective", "full")


# the split backward's (zb-h1) input-gradient pass B as a share of a backward: the linears'
# input and weight gradients cost alike, the attention scores' gradients are the input's alone
INPUT_GRADIENT_SHARE = 0.55


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    micro_batch_size: int
    recompute: str | None  # None | "selective" | "full"
    schedule: str  # one of pipeline.schedules.SCHEDULES
    layer_split: tuple[int, ...] | None = None  # layers per stage; None: the runtime's even split
    chunks: int = 1  # interleaved: model chunks per rank (v)
    # per stage, how many of its first layers recompute in full (stage_plan.py); recompute None
    recompute_layers: tuple[int, ...] | None = None

    @property
    def recompute_label(self) -> str:
        if self.recompute_layers is not None:
            return "per-stage " + ",".join(map(str, self.recompute_layers))
        return self.recompute or "none"

    def microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.data_parallel)

    def parallel_config(self, base: ParallelConfig | None = None) -> ParallelConfig:
        """`base` (every other setting kept) with this candidate's layout and schedule."""
        return dataclasses.replace(
            base or ParallelConfig(), tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel, schedule=self.schedule,
            layer_split=list(self.layer_split) if self.layer_split else None,
            virtual_pipeline_parallel=self.chunks if self.chunks > 1 else None,
            num_layers_per_virtual_pipeline_stage=None)

    def describe(self) -> str:
        split = f" split={','.join(map(str, self.layer_split))}" if self.layer_split else ""
        return (f"t={self.tensor_parallel} p={self.pipeline_parallel} d={self.data_parallel} "
                f"b={self.micro_batch_size} recompute={self.recompute_label} "
                f"{self.schedule}{f' v={self.chunks}' if self.chunks > 1 else ''}{split}")


@dataclass(frozen=True)
class StageCost:
    """Seconds for one rank of a stage (all replicas behave alike)."""
    forward_s: float  # one microbatch, tensor-parallel all-reduces included
    backward_s: float  # one microbatch, recomputation included
    send_act_s: float  # activation transfer to the next stage (0 on the last)
    send_grad_s: float  # gradient transfer to the previous stage (0 on the first)
    reduce_s: float  # blocking: gradients into the master copy, zeroing, the norm's pass
    reduce_async_s: float  # the grad-norm all-reduce the step waits for (after every reduce)
    step_s: float  # optimizer + new weight version
    tied_async_s: float = 0.0  # first stage of p > 1: the tied-embedding all-reduce it waits for
    # at its step before adding its part of the grad norm (the other stages' steps wait for that)
    # the parts of forward_s, backward_s and step_s a rank spends blocked in collectives:
    # it needs no processor then, which matters where ranks share one (CoreSharing)
    forward_comm_s: float = 0.0
    backward_comm_s: float = 0.0
    step_comm_s: float = 0.0
    # the tensor-parallel collectives of one forward and one backward, in all-reduces (under
    # --sequence-parallel a lone reduce-scatter or all-gather counts half: tensor_collectives),
    # and the wait for a peer's turn each includes (Network.wake_s, part of *_comm_s). Where
    # ranks share processors the replay alternates them with the compute, pays that wait only
    # while other ranks of the node have work, and lets the group's lagging peer compute in it
    forward_collectives: float = 0.0
    backward_collectives: float = 0.0
    wake_s: float = 0.0
    # the data-parallel all-reduce (or reduce-scatter) of the gradient buffer: it runs on after
    # reduce and must be in before the stage's next backward or its step (update.py)
    reduce_background_s: float = 0.0
    # CPU ranks (measured; 0 on devices): processor seconds of the tensor-parallel all-reduces of
    # one microbatch (forward and backward), and of the batch's data-parallel collectives (the
    # gradients' reduction; with the distributed optimizer, the weights' gather too). gloo
    # reduces on the cores the ranks compute on: these count in a node's processor budget where
    # ranks share cores (CoreSharing), though the rank itself is blocked or computing then
    comm_processor_s: float = 0.0
    batch_comm_processor_s: float = 0.0
    # CPU ranks: how much more processor time this stage's compute needs while its rank takes
    # turns with another on a processor (ComputeCosts.turn_taking_overhead)
    turn_overhead: float = 0.0

    def processor_time(self, microbatches: int, taking_turns: bool = False) -> float:
        """Seconds per batch this rank needs a processor for: its computation (slowed by
        turn_overhead where it takes turns) and its collectives' processor work, not its
        waits."""
        compute = self.forward_s - self.forward_comm_s + self.backward_s - self.backward_comm_s
        slowdown = 1.0 + self.turn_overhead if taking_turns else 1.0
        return (microbatches * (compute * slowdown + self.comm_processor_s)
                + self.reduce_s + self.step_s - self.step_comm_s + self.batch_comm_processor_s)


# ---------------------------------------------------------------------------------------------
# Links and collectives

class Network:
    """Transfer and collective times for the runtime's rank placement on `hardware`."""

    def __init__(self, hardware: HardwareSpec, tensor: int, pipeline: int, data: int):
        self.hardware = hardware
        self.layout = ParallelLayout(tensor * pipeline * data, tensor, pipeline)
        self._cache: dict[tuple, object] = {}
        per_node = hardware.devices_per_node
        self.ranks_per_node = min(tensor * pipeline * data, per_node)
        self.shares_processors = hardware.shares_processors(tensor * pipeline * data)
        if tensor > per_node or per_node % tensor:
            raise ValueError(f"tensor-parallel size {tensor} must divide the {per_node} devices of "
                             f"a node (tensor-parallel all-reduces stay inside a node)")

    def wake_s(self, group_size: int) -> float:
        """Extra wait of a blocking transfer or collective over `group_size` ranks on a node that
        runs more ranks than processors, when the node has ranks outside the group (they may be
        computing): a peer that lost its turn to them gets the processor back after half a
        scheduler slice on average. 0 with a processor per rank, or a group spanning the node
        (the measured all-reduce times already hold that case)."""
        slice_s = self.hardware.scheduler_slice_s
        if slice_s is None or not self.shares_processors or group_size >= self.ranks_per_node:
            return 0.0
        return slice_s / 2

    def node(self, rank: int) -> int:
        return rank // self.hardware.devices_per_node

    def _link_times(self, hops: list[tuple[int, int]], collective: bool = False
                    ) -> list[tuple[float, float]]:
        """(seconds per byte, latency) of each hop when all hops carry traffic at once; a
        collective's hops inside a node take the measured collective hop latency if there is one."""
        hw = self.hardware
        intra_latency = hw.collective_hop_latency_s if collective and \
            hw.collective_hop_latency_s is not None else hw.intra_node_latency_s
        leaving: dict[int, int] = {}
        entering: dict[int, int] = {}
        nodes = [(self.node(src), self.node(dst)) for src, dst in hops]
        for src, dst in nodes:
            if src != dst:
                leaving[src] = leaving.get(src, 0) + 1
                entering[dst] = entering.get(dst, 0) + 1
        return [(1.0 / hw.intra_node_bandwidth, intra_latency) if src == dst else
                (max(leaving[src], entering[dst]) / hw.inter_node_bandwidth, hw.inter_node_latency_s)
                for src, dst in nodes]

    def _rings(self, kind: str, stage: int | None) -> list[tuple[int, float, float, bool]]:
        """(ranks, seconds per byte of the slowest hop, worst hop latency, inside one node) of
        each ring of a group kind, when all of them run at once."""
        key = ("ring", kind, stage)
        if key not in self._cache:
            rings = [sorted(g) for g in self.groups(kind, stage) if len(g) > 1]
            hops = [(r[i], r[(i + 1) % len(r)]) for r in rings for i in range(len(r))]
            links = iter(self._link_times(hops, collective=True))
            result = []
            for ring in rings:
                ring_links = [next(links) for _ in ring]
                result.append((len(ring), max(x[0] for x in ring_links),
                               max(x[1] for x in ring_links),
                               len({self.node(r) for r in ring}) == 1))
            self._cache[key] = result
        return self._cache[key]

    def allreduce_time(self, kind: str, nbytes: float, stage: int | None = None,
                       buckets: int = 1, after_compute_s: float = 0.0) -> float:
        """Concurrent ring all-reduces of nbytes over every group of `kind` (of one stage); inside
        a node the measured all-reduce times when the hardware has them, and, for all-reduces
        that each follow `after_compute_s` of compute, the measured extra of meeting after
        compute."""
        def one_ring(n: int, per_byte: float, latency: float, in_node: bool) -> float:
            measured = self.hardware.measured_allreduce_s(n, nbytes / buckets) if in_node \
                else None
            waits = self.wake_s(n) + (self.hardware.allreduce_after_compute_s(after_compute_s)
                                      if in_node else 0.0)
            if measured is not None:
                return buckets * (measured + waits)
            return 2 * (n - 1) / n * nbytes * per_byte + buckets * (2 * (n - 1) * latency
                                                                  + waits)
        return max((one_ring(*ring) for ring in self._rings(kind, stage)), default=0.0)

    def transfer_time(self, src_stage: int, dst_stage: int, nbytes: float) -> float:
        """Every replica sends nbytes from src_stage to dst_stage at once: the slowest transfer."""
        key = ("p2p", src_stage, dst_stage)
        if key not in self._cache:
            lay = self.layout
            pairs = [(lay.rank_of(tp, dp, src_stage), lay.rank_of(tp, dp, dst_stage))
                     for dp in range(lay.data) for tp in range(lay.tensor)]
            links = self._link_times(pairs)
            self._cache[key] = (max(x[0] for x in links), max(x[1] for x in links))
        per_byte, latency = self._cache[key]
        return latency + nbytes * per_byte + self.wake_s(2)

    def groups(self, kind: str, stage: int | None = None) -> list[list[int]]:
        key = ("groups", kind, stage)
        if key not in self._cache:
            groups = self.layout.group_ranks(kind)
            self._cache[key] = groups if stage is None else \
                [g for g in groups if self.layout.coordinates(g[0]).pp == stage]
        return self._cache[key]


@lru_cache(maxsize=64)
def _network(hardware: HardwareSpec, tensor: int, pipeline: int, data: int) -> Network:
    return Network(hardware, tensor, pipeline, data)


# ---------------------------------------------------------------------------------------------
# Durations of one configuration

# fp32 bytes read+written per parameter (Muon's matrices: gradient, buffer, Nesterov's update,
# weights; AdamW for the rest)
OPTIMIZER_STEP_BYTES = {"adam": 28, "sgd": 20, "muon": 28}
MUON_NS_STEPS = 5  # --muon-num-ns-steps' default (the planner takes the optimizer's name only)


def newton_schulz_flops(shape: tuple[int, int], steps: int = MUON_NS_STEPS) -> float:
    """One orthogonalisation of a matrix (optim/muon.newton_schulz): per step X X^T, the Gram
    matrix squared and the product with X, m = the smaller side."""
    m, n = min(shape), max(shape)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def muon_step_times(model: ModelConfig, hardware: HardwareSpec, net, stage: int, layers: int,
                    matrices: int, parameters: int, tensor: int, shards: int) -> tuple[float, float]:
    """(compute, communication) seconds Muon adds to a stage's step (modelled): every rank
    orthogonalises each of its layers' matrices whole, in bf16; the matrices' fp32 updates are
    all-gathered over the tensor-parallel group, and under the distributed optimizer the stage's
    flat shard over the data-parallel group (an all-gather: half an all-reduce's time)."""
    rate = hardware.peak_flops.get("bfloat16") or max(hardware.peak_flops.values())
    compute = layers * sum(newton_schulz_flops(shape) for shape in layer_matrix_shapes(model)) / (
        rate * hardware.efficiency)
    comm = net.allreduce_time("tensor", 4 * matrices, stage) / 2 if tensor > 1 else 0.0
    if shards > 1:
        comm += net.allreduce_time("data", 4 * parameters, stage) / 2
    return compute, comm


@dataclass(frozen=True)
class PieceTimes:
    """One microbatch on one rank, tensor-parallel all-reduces and recomputation included; the
    *_comm_s parts are those all-reduces."""
    layer_forward_s: float
    layer_backward_s: float
    embedding_forward_s: float
    embedding_backward_s: float
    head_forward_s: float
    head_backward_s: float
    layer_forward_comm_s: float = 0.0
    layer_backward_comm_s: float = 0.0
    embedding_forward_comm_s: float = 0.0
    embedding_backward_comm_s: float = 0.0  # --sequence-parallel: the embedding's all-gather
    head_forward_comm_s: float = 0.0
    head_backward_comm_s: float = 0.0
    # processor seconds of those all-reduces (forward and backward; StageCost.comm_processor_s)
    layer_comm_processor_s: float = 0.0
    embedding_comm_processor_s: float = 0.0
    head_comm_processor_s: float = 0.0


def tensor_collectives(layers: int, first: bool, last: bool, recompute: str | None,
                       sequence_parallel: bool) -> tuple[float, float]:
    """The blocking tensor-parallel collectives of a stage's forward and backward, in all-reduces
    (at t > 1; piece_times charges each): a layer meets twice per pass (after attention, after
    the MLP; full recomputation reruns the forward's in backward), the embedding once (under
    --sequence-parallel a reduce-scatter forward and an all-gather backward, half each), the
    loss three times (max, target logit, sum), the head once backward and, under
    --sequence-parallel, its gather of the sequence forward (half)."""
    half = 0.5 if sequence_parallel else 0.0
    forward = 2 * layers + (1 - half) * first + (3 + half) * last
    backward = 2 * layers * (2 if recompute == "full" else 1) + half * first + last
    return forward, backward


def piece_times(model: ModelConfig, network: Network, costs: ComputeCosts, micro_batch_size: int,
                recompute: str | None, precision: PrecisionConfig) -> PieceTimes:
    activation = micro_batch_size * model.seq_length * model.hidden_size * dtype_bytes(precision)

    def tensor_ar(after_compute_s: float, nbytes: float = activation) -> float:
        return network.allreduce_time("tensor", nbytes, after_compute_s=after_compute_s)
    # each all-reduce follows the compute since the previous one: a layer meets twice per pass
    # (after attention, after the MLP), the loss three times (max, target logit, sum); under
    # --sequence-parallel a layer's all-gather + reduce-scatter pairs cost its all-reduces
    # (module docstring), the embedding's all-reduce splits into a reduce-scatter forward and an
    # all-gather backward, and the head gathers the sequence (half an all-reduce each)
    layer_f_ar = tensor_ar(costs.layer_forward_s / 2)
    layer_b_ar = tensor_ar(costs.layer_backward_s / 2)
    embedding_ar = tensor_ar(costs.embedding_forward_s)
    sequence_parallel = model.sequence_ranks(network.layout.tensor) > 1
    embedding_f_ar = embedding_ar / 2 if sequence_parallel else embedding_ar
    embedding_b_ar = embedding_ar / 2 if sequence_parallel else 0.0
    # the head's gather follows the last layer's reduce-scatter with hardly any compute between
    head_gather = tensor_ar(0.0) / 2 if sequence_parallel else 0.0
    loss_bytes = 4 * micro_batch_size * model.seq_length  # one fp32 figure per token
    loss_ar = tensor_ar(costs.head_forward_s / 3, loss_bytes)
    head_b_ar = tensor_ar(costs.head_backward_s)
    layer_f = costs.layer_forward_s + 2 * layer_f_ar
    layer_b = costs.layer_backward_s + 2 * layer_b_ar
    layer_b_comm = 2 * layer_b_ar
    layer_calls = sum(tensor_collectives(1, False, False, recompute, sequence_parallel))
    if recompute == "full":
        layer_b += layer_f
        layer_b_comm += 2 * layer_f_ar
    elif recompute == "selective":
        layer_b += costs.attention_core_forward_s
    # measured for groups of 2 or more only: nothing at t = 1
    processor = network.hardware.allreduce_processor_s(network.layout.tensor, activation)
    loss_processor = network.hardware.allreduce_processor_s(network.layout.tensor, loss_bytes)
    head_f_comm = 3 * loss_ar + head_gather
    return PieceTimes(layer_f, layer_b, costs.embedding_forward_s + embedding_f_ar,
                      costs.embedding_backward_s + embedding_b_ar,
                      costs.head_forward_s + head_f_comm, costs.head_backward_s + head_b_ar,
                      layer_forward_comm_s=2 * layer_f_ar, layer_backward_comm_s=layer_b_comm,
                      embedding_forward_comm_s=embedding_f_ar,
                      embedding_backward_comm_s=embedding_b_ar, head_forward_comm_s=head_f_comm,
                      head_backward_comm_s=head_b_ar,
                      layer_comm_processor_s=layer_calls * processor,
                      embedding_comm_processor_s=processor,
                      head_comm_processor_s=3 * loss_processor
                      + (1.5 if sequence_parallel else 1) * processor)


def balanced_layer_split(layers: int, stages: int, layer_s: float, first_extra_s: float,
                         last_extra_s: float) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's compute, where the first stage also runs
    the embedding and the last the head; where the slowest stage leaves room, the earlier stages
    get fewer layers (they hold more microbatches in flight)."""
    if stages == 1:
        return (layers,)
    extras = [first_extra_s] + [0.0] * (stages - 2) + [last_extra_s]

    def capacities(limit: float) -> list[int]:
        return [max(1, int((limit - extra) / layer_s + 1e-9)) for extra in extras]

    # the best limit is one of the stage times n * layer_s + extra
    options = sorted({n * layer_s + extra for extra in extras for n in range(1, layers + 1)})
    limit = next(x for x in options if sum(capacities(x)) >= layers)
    split = capacities(limit)
    excess = sum(split) - layers
    while excess:  # one layer at a time off the earliest stages, keeping at least one each
        for s in range(stages):
            if excess and split[s] > 1:
                split[s] -= 1
                excess -= 1
    return tuple(split)


def balanced_split(model: ModelConfig, hardware: HardwareSpec, costs: ComputeCosts,
                   candidate: Candidate, precision: PrecisionConfig) -> tuple[int, ...]:
    """`balanced_layer_split` for a candidate's pieces."""
    c = candidate
    net = _network(hardware.for_world(c.tensor_parallel * c.pipeline_parallel * c.data_parallel),
                   c.tensor_parallel, c.pipeline_parallel, c.data_parallel)
    pieces = piece_times(model, net, costs, c.micro_batch_size, c.recompute, precision)
    return balanced_layer_split(model.num_layers, c.pipeline_parallel,
                                pieces.layer_forward_s + pieces.layer_backward_s,
                                pieces.embedding_forward_s + pieces.embedding_backward_s,
                                pieces.head_forward_s + pieces.head_backward_s)


def layer_costs(model: ModelConfig, hardware: HardwareSpec, costs: ComputeCosts,
                candidate: Candidate, precision: PrecisionConfig) -> LayerCosts:
    """Every layer's pieces (all alike) and the stage extras, for stage_plan.plan_stages: a
    recomputed layer's backward is full recomputation's."""
    c = candidate
    net = _network(hardware.for_world(c.tensor_parallel * c.pipeline_parallel * c.data_parallel),
                   c.tensor_parallel, c.pipeline_parallel, c.data_parallel)
    plain = piece_times(model, net, costs, c.micro_batch_size, None, precision)
    full = piece_times(model, net, costs, c.micro_batch_size, "full", precision)
    return LayerCosts.uniform(model.num_layers, plain.layer_forward_s, plain.layer_backward_s,
                              full.layer_backward_s - plain.layer_backward_s,
                              plain.embedding_forward_s + plain.embedding_backward_s,
                              plain.head_forward_s + plain.head_backward_s)


def stage_costs(model: ModelConfig, hardware: HardwareSpec, costs: ComputeCosts,
                candidate: Candidate, precision: PrecisionConfig, optimizer: str,
                parallel: ParallelConfig | None = None) -> list[StageCost]:
    """Per-stage durations of `candidate` (costs = the profile's ComputeCosts at its t and b)."""
    parallel = parallel or ParallelConfig()
    t, p, d = candidate.tensor_parallel, candidate.pipeline_parallel, candidate.data_parallel
    b = candidate.micro_batch_size
    hardware = hardware.for_world(t * p * d)
    net = _network(hardware, t, p, d)
    e, g = dtype_bytes(precision), grad_buffer_bytes(precision)
    # a pipeline message: s/t tokens under --sequence-parallel
    message = b * model.seq_length * model.hidden_size * e / model.sequence_ranks(t)
    pieces = piece_times(model, net, costs, b, candidate.recompute, precision)
    recomputed = candidate.recompute_layers or (0,) * p
    full = piece_times(model, net, costs, b, "full", precision) if any(recomputed) else pieces
    memory_rate = hardware.memory_bandwidth * hardware.efficiency
    stats_ar = net.allreduce_time("model", 4)
    tied_bytes = 4 * model.padded_vocab_size(t) // t * model.hidden_size  # fp32 master gradients
    tied = p > 1 and not model.untie_embeddings_and_output_weights
    tied_ar = net.allreduce_time("embedding", tied_bytes) if tied else 0.0
    shards = d if parallel.use_distributed_optimizer else 1
    # as in memory.py: in fp32 the master weights are (this rank's part of) a working copy, under
    # 2BW the newest version's
    fp32 = e == 4 and g == 4
    fp32_versions = fp32 and candidate.schedule in NEVER_DRAINED and \
        candidate.schedule != "pipemare"  # PipeMare's one version is the master weights
    layer_counts = list(candidate.layer_split) if candidate.layer_split else \
        [len(r) for r in layer_ranges(model.num_layers, p)]

    result = []
    for s, layers in enumerate(layer_counts):
        first, last = s == 0, s == p - 1
        forward = layers * pieces.layer_forward_s
        backward = layers * pieces.layer_backward_s
        forward_comm = layers * pieces.layer_forward_comm_s
        backward_comm = layers * pieces.layer_backward_comm_s
        comm_processor = layers * pieces.layer_comm_processor_s
        k = recomputed[s]  # a per-stage plan's layers that recompute: full's pieces instead
        backward += k * (full.layer_backward_s - pieces.layer_backward_s)
        backward_comm += k * (full.layer_backward_comm_s - pieces.layer_backward_comm_s)
        comm_processor += k * (full.layer_comm_processor_s - pieces.layer_comm_processor_s)
        if first:
            forward += pieces.embedding_forward_s
            backward += pieces.embedding_backward_s
            forward_comm += pieces.embedding_forward_comm_s
            backward_comm += pieces.embedding_backward_comm_s
            comm_processor += pieces.embedding_comm_processor_s
        if last:
            forward += pieces.head_forward_s
            backward += pieces.head_backward_s
            forward_comm += pieces.head_forward_comm_s
            backward_comm += pieces.head_backward_comm_s
            comm_processor += pieces.head_comm_processor_s
        # each pass receives from one neighbour and sends to the other (none beyond the ends)
        messages = int(not first) + int(not last)
        forward += messages * hardware.p2p_processor_s
        backward += messages * hardware.p2p_processor_s
        forward_collectives, backward_collectives = tensor_collectives(
            layers, first, last, candidate.recompute, model.sequence_ranks(t) > 1) \
            if t > 1 else (0.0, 0.0)
        if t > 1 and k:  # a recomputed layer meets its forward's collectives again in backward
            backward_collectives += tensor_collectives(k, False, False, None, False)[0]

        P = stage_parameters(model, t, layers, first, last)
        buckets = max(1, math.ceil(P / parallel.ddp_bucket_size))
        data_ar = net.allreduce_time("data", g * P, s, buckets)
        # processor seconds of the batch's collectives (measured groups only: none of one rank):
        # the gradients' reduction; the loss sums' (last stage); the tied embedding's (first and
        # last stage); the norm's sum over the model group (first over the shards, if sharded)
        batch_processor = buckets * hardware.allreduce_processor_s(d, g * P / buckets)
        batch_processor += (hardware.allreduce_processor_s(d, 16) if last else 0.0) \
            + (hardware.allreduce_processor_s(2, tied_bytes) if tied and (first or last) else 0.0) \
            + hardware.allreduce_processor_s(t * p, 4) \
            + (hardware.allreduce_processor_s(d, 4) if shards > 1 else 0.0)
        # the buffer into the master gradients unless they are the buffer (one version, fp32
        # gradients: WeightVersions.shared_grads): a copy and a zeroing pass, or where both are
        # whole and fp32 and trade storage the zeroing alone; the grad norm
        shared_grads = live_versions(candidate.schedule, p, s) == 1 and g == 4
        swaps_gradients = g == 4 and shards == 1
        move = 0 if shared_grads else g if swaps_gradients else 2 * g + 4
        local = move * P + 12 * P
        # the blocking all-reduce over the tensor-parallel group of the replicated parameters'
        # gradients each rank computes in part, after the data-parallel average: of the part
        # this rank averaged (update.py, sum_tensor_partial_grads)
        summed = g * stage_tensor_partial_grad_parameters(model, t, layers, first, last) / shards
        partial_ar = net.allreduce_time("tensor", summed, s) if summed else 0.0
        # optimizer + unscaling, and the new working version: written from the master weights or,
        # where they are the newest version, a copy of this rank's part of it before the step;
        # none on the last stage, which steps right after releasing the older version's copy and
        # updates that in place (WeightVersions.prepare_step)
        if fp32_versions:
            version = 0 if last else (4 + e) * P / shards
        else:
            version = 0 if fp32 else (4 + e) * P
        step = (OPTIMIZER_STEP_BYTES[optimizer] + 8) * P / shards + version
        step_comm = 0.0
        if shards > 1:  # each replica updates its shard, then the working weights are gathered
            batch_processor += hardware.allreduce_processor_s(d, e * P) / 2
            # in the background (pipeline/param_gather.py): under 2BW and PipeDream the new
            # version is first read a batch later, so its gather is off the critical path; a
            # flushed pipeline's next forward waits for it (its first layers overlap the rest:
            # not modelled)
            if candidate.schedule not in NEVER_DRAINED:
                step_comm = net.allreduce_time("data", e * P, s) / 2
        muon_compute = 0.0
        if optimizer == "muon":
            matrices = stage_hidden_matrix_parameters(model, t, layers, first, last)
            muon_compute, muon_comm = muon_step_times(model, hardware, net, s, layers, matrices,
                                                      P, t, shards)
            step_comm += muon_comm
        result.append(StageCost(
            forward_s=forward, backward_s=backward,
            send_act_s=0.0 if last else net.transfer_time(s, s + 1, message),
            send_grad_s=0.0 if first else net.transfer_time(s, s - 1, message),
            reduce_s=local / memory_rate + partial_ar,
            reduce_async_s=stats_ar,
            step_s=step / memory_rate + muon_compute + step_comm,
            tied_async_s=tied_ar if first and not last else 0.0,
            forward_comm_s=forward_comm, backward_comm_s=backward_comm, step_comm_s=step_comm,
            forward_collectives=forward_collectives, backward_collectives=backward_collectives,
            wake_s=net.wake_s(t) if t > 1 else 0.0,
            reduce_background_s=data_ar, comm_processor_s=comm_processor,
            batch_comm_processor_s=batch_processor, turn_overhead=costs.turn_taking_overhead))
    return result


def bottleneck_label(breakdown: dict[str, float], busiest_stage: int) -> str:
    """The largest share of the busiest stage's time per batch, as a name."""
    share = max(breakdown, key=breakdown.get)
    return {"compute": f"compute stage {busiest_stage}", "p2p": "p2p",
            "data_parallel": "data-parallel all-reduce", "bubble": "pipeline bubble",
            "shared_cores": "ranks sharing cores"}[share]


@dataclass(frozen=True)
class CoreSharing:
    """A node running more ranks than it has processors (CPU ranks sharing cores): the ranks of
    each stage on each node, and a node's processors. The replay (simulator.py) shares a node's
    processors equally among its ranks computing at that moment; a rank blocked in a transfer or
    a collective needs none, except that a tensor-parallel group waiting for a peer's turn holds
    one processor (the lagging peer computes). On a node with more ranks than processors every
    rank's compute pays its turn-taking overhead, even while the others wait: each turn finds
    its caches cold. (Measured with 4 ranks on 2 cores under 2BW, Flush and pure data
    parallelism, each rank's processor seconds in training came to its pieces times 1 +
    turn_overhead.)"""
    ranks: tuple[tuple[int, ...], ...]  # [node][stage]
    slots: int
    tensor_parallel: int = 1  # ranks per tensor-parallel group (inside one node)

    def crowded(self, node: int) -> bool:
        """Whether `node` runs more ranks than it has processors."""
        return sum(self.ranks[node]) > self.slots

    def bound(self, stages: list[StageCost], microbatches: int) -> float:
        """The least time per batch: each node's processors must get through the processor time
        of all its ranks."""
        return max(sum(n * st.processor_time(microbatches, self.crowded(i))
                       for n, st in zip(node, stages))
                   for i, node in enumerate(self.ranks)) / self.slots


def core_sharing(hardware: HardwareSpec, candidate: Candidate) -> CoreSharing | None:
    """How `candidate`'s ranks share the processors of `hardware`'s nodes; None when every rank
    has one of its own (GPUs: one per device)."""
    c = candidate
    world = c.tensor_parallel * c.pipeline_parallel * c.data_parallel
    hardware = hardware.for_world(world)
    if not hardware.shares_processors(world):
        return None
    layout = ParallelLayout(world, c.tensor_parallel, c.pipeline_parallel)
    ranks = [[0] * c.pipeline_parallel for _ in range(hardware.nodes)]
    for rank in range(world):
        ranks[rank // hardware.devices_per_node][layout.coordinates(rank).pp] += 1
    return CoreSharing(tuple(map(tuple, ranks)), hardware.compute_slots, c.tensor_parallel)


def busiest_stage(stages: list[StageCost], microbatches: int) -> int:
    busy = [microbatches * (c.forward_s + c.backward_s) + c.reduce_s + c.step_s for c in stages]
    return max(range(len(stages)), key=busy.__getitem__)


def paper_breakdown(stages: list[StageCost], schedule: str, microbatches: int,
                    chunks: int = 1) -> dict[str, float]:
    """PipeDream-2BW's closed form, extended to the flushed schedules' bubbles, as the busiest
    stage's time per batch by cause (their sum is the predicted time per batch).

    A microbatch takes the slowest stage's compute plus its p2p time (the activation out and the
    gradient back over its busier neighbouring link). 2BW overlaps the per-batch data-parallel work
    (reduce and step) with later microbatches, so it costs only what exceeds m microbatches; Flush
    and GPipe fill and drain the pipeline ((m + p - 1) microbatch slots), then reduce and step.
    """
    p, m = len(stages), microbatches

    def link(s: int) -> float:  # activation s -> s+1 plus gradient s+1 -> s
        return stages[s].send_act_s + stages[s + 1].send_grad_s if 0 <= s < p - 1 else 0.0

    k = max(range(p), key=lambda s: stages[s].forward_s + stages[s].backward_s
            + max(link(s), link(s - 1)))
    compute = stages[k].forward_s + stages[k].backward_s
    p2p = max(link(k), link(k - 1))
    data_parallel = max(st.reduce_s + st.reduce_background_s + st.step_s for st in stages)
    if schedule in NEVER_DRAINED:
        return {"compute": m * compute, "p2p": m * p2p,
                "data_parallel": max(data_parallel - m * (compute + p2p), 0.0), "bubble": 0.0}
    return {"compute": m * compute, "p2p": m * p2p, "data_parallel": data_parallel,
            "bubble": (p - 1) * fill_per_stage(stages[k], schedule, p2p, chunks)}


def fill_per_stage(stage: StageCost, schedule: str, p2p: float, chunks: int = 1) -> float:
    """A flushed schedule's fill and drain per stage of the pipeline: a microbatch's forward and
    backward (1F1B, GPipe); interleaved: of one chunk; zb-h1: the W passes fill the drain, so a
    forward and the input gradient less the weight gradient (Qi et al.)."""
    if schedule == "zb-h1":
        share = INPUT_GRADIENT_SHARE
        return max(stage.forward_s + stage.backward_s * (2 * share - 1), 0.0) + p2p
    return (stage.forward_s + stage.backward_s + p2p) / chunks


def paper_time_per_batch(stages: list[StageCost], schedule: str, microbatches: int,
                         chunks: int = 1) -> float:
    return sum(paper_breakdown(stages, schedule, microbatches, chunks).values())


def time_per_batch_lower_bound(stages: list[StageCost], schedule: str, microbatches: int,
                               chunks: int = 1) -> float:
    """What a replay of the schedule (simulator.py) cannot beat, cheaply:
    - every stage runs its microbatches, its reduce and its step each batch;
    - a link carries one transfer at a time;
    - 1F1B (2BW, Flush): two neighbouring stages alternate so that, per microbatch, both
      computations and the activation and gradient transfers between them follow one another
      (half each per microbatch, once m - p + 1 microbatches are past the warm-up);
    - Flush and GPipe: a batch also holds the path "microbatch 0 reaches stage k, stage k runs all
      its microbatches, the last gradient returns to stage 0", then stage 0's reduce, background
      collectives and step (interleaved: the path's hops are chunks, 1/v of a stage; zb-h1: the
      forwards' way alone, stage k's deferred W passes may overlap the gradient's way back).
    The search replays candidates in the order of this bound."""
    m, p = microbatches, len(stages)
    own = [st.forward_s + st.backward_s for st in stages]
    bound = max(m * own[s] + st.reduce_s + st.step_s for s, st in enumerate(stages))
    bound = max(bound, m * max(max(st.send_act_s, st.send_grad_s) for st in stages))
    if schedule in ("2bw", "flush") and p > 1:
        pair = max(own[s] + own[s + 1] + stages[s].send_act_s + stages[s + 1].send_grad_s
                   for s in range(p - 1)) / 2
        bound = max(bound, (m - p + 1) * pair)
    if schedule not in NEVER_DRAINED:
        first = stages[0]
        # the fill before stage k and the drain after it: a forward and a backward per stage
        # before it (interleaved: of a chunk); zb-h1: the forwards alone (stage k's deferred W
        # passes may overlap the gradient's way back)
        fill = [st.forward_s + (0.0 if schedule == "zb-h1" else st.backward_s) for st in stages]
        path = max(m * own[k] + sum(fill[:k]) / chunks for k in range(p))
        bound = max(bound, path + first.reduce_s + first.reduce_background_s
                    + first.tied_async_s + first.reduce_async_s + first.step_s)
    return bound
