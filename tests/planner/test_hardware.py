import contextlib
import os

import pytest
import torch.distributed as dist

from megatron_2bw.distributed.launch import bind_cores
from megatron_2bw.planner.hardware import (AFTER_COMPUTE_SEGMENTS_S, ALLREDUCE_PROBE_BYTES,
                                           HardwareSpec, detect_hardware, load_hardware,
                                           parse_quantity, probe_allreduce_after_compute,
                                           probe_allreduce_times, probe_p2p_processor_time,
                                           probe_scheduler_slice, shipped_hardware)
from megatron_2bw.planner import hardware
from tests.distributed_helpers import run_ranks
from tests.virtual_clock import VirtualClock, installed

GOOD = """
name: toy
devices_per_node: 4
memory_per_device: 2 GiB
intra_node_bandwidth: 100 GB/s
intra_node_latency: 5 us
inter_node_bandwidth: 100 Gbit/s
inter_node_latency: 20 us
peak_flops: {float32: 10 TFLOPS, bfloat16: 80 TFLOPS}
memory_bandwidth: 1 TB/s
efficiency: 50%
reserved_memory: 256 MiB
kernel_overhead: 4 us
"""


def write(tmp_path, text, name="hw.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_files_load_with_the_papers_cluster_figures():
    assert {"p3.16xlarge", "dgx-a100", "dgx-h100"} <= set(shipped_hardware())
    p3 = load_hardware("p3.16xlarge")
    assert (p3.devices_per_node, p3.memory_per_device_bytes) == (8, 16 * 2**30)
    assert p3.inter_node_bandwidth == 25e9 / 8  # 25 Gbit/s
    assert p3.intra_node_bandwidth == 25e9
    assert p3.flops_for("float16") == 125e12 and p3.memory_bandwidth == 900e9
    with pytest.raises(ValueError, match="bfloat16"):  # V100 has no bf16 tensor cores
        p3.flops_for("bfloat16")
    a100, h100 = load_hardware("dgx-a100"), load_hardware("dgx-h100")
    assert a100.inter_node_bandwidth == 8 * 200e9 / 8 and h100.inter_node_bandwidth == 8 * 400e9 / 8
    assert a100.flops_for("bfloat16") == 312e12 and h100.intra_node_bandwidth == 450e9
    assert p3.kernel_overhead_s == pytest.approx(5e-6) and p3.efficiency == 0.4
    # the one-GPU files of `make gpu-check`: a large GEMM's share of the peak on those GPUs
    for name in ("h100-sxm-1gpu", "h200-1gpu"):
        assert load_hardware(name).efficiency == 0.8 and load_hardware(name).device_type == "cuda"


def test_units_and_a_full_file(tmp_path):
    assert parse_quantity("16 GiB", "bytes", "x") == 16 * 2**30
    assert parse_quantity("25 Gbit/s", "bandwidth", "x") == 25e9 / 8
    assert parse_quantity("25Gbps", "bandwidth", "x") == 25e9 / 8
    assert parse_quantity("10 us", "seconds", "x") == pytest.approx(1e-5)
    assert parse_quantity(3.5e9, "bandwidth", "x") == 3.5e9
    spec = load_hardware(write(tmp_path, GOOD))
    assert spec == HardwareSpec(
        name="toy", devices_per_node=4, nodes=1, memory_per_device_bytes=2 * 2**30,
        intra_node_bandwidth=100e9, intra_node_latency_s=pytest.approx(5e-6),
        inter_node_bandwidth=12.5e9, inter_node_latency_s=pytest.approx(2e-5),
        peak_flops={"float32": 10e12, "bfloat16": 80e12}, memory_bandwidth=1e12, efficiency=0.5,
        reserved_memory_bytes=256 * 2**20, kernel_overhead_s=pytest.approx(4e-6),
        source=str(tmp_path / "hw.yaml"))
    assert spec.usable_memory_bytes == 2 * 2**30 - 256 * 2**20
    assert spec.for_world(10).nodes == 3 and spec.for_world(10).world_size == 12
    assert spec.compute_slots == 4  # one processor per device unless the file says otherwise
    cpu = load_hardware(write(tmp_path, GOOD + "compute_slots_per_node: 2\nscheduler_slice: 4 ms\n"
                              "p2p_processor_time: 0.5 ms\n", "cpu.yaml"))
    assert (cpu.compute_slots_per_node, cpu.compute_slots) == (2, 2)
    assert cpu.scheduler_slice_s == pytest.approx(0.004) and spec.scheduler_slice_s is None
    assert cpu.p2p_processor_s == pytest.approx(5e-4) and spec.p2p_processor_s == 0.0
    # the attention kernels the planner counts: CUDA's fused ones unless the file says cpu
    assert spec.device_type == "cuda"
    assert load_hardware(write(tmp_path, GOOD + "device: cpu\n", "d.yaml")).device_type == "cpu"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("devices_per_node: 4\n", ""), "missing field.*devices_per_node"),
    (lambda t: t + "colour: blue\n", "unknown field.*colour"),
    (lambda t: t.replace("100 GB/s", "100 furlongs"), "intra_node_bandwidth.*100 furlongs"),
    (lambda t: t.replace("2 GiB", "-2 GiB"), "memory_per_device must be positive"),
    (lambda t: t.replace("float32:", "float8:"), "unknown dtype.*float8"),
    (lambda t: t.replace("devices_per_node: 4", "devices_per_node: four"), "positive integer"),
    (lambda t: t.replace("efficiency: 50%", "efficiency: 1.5"), r"efficiency must be in \(0, 1\]"),
    (lambda t: t + "compute_slots_per_node: 0\n", "compute_slots_per_node must be a positive"),
    (lambda t: t + "device: tpu\n", "device must be one of cuda, cpu, got 'tpu'"),
    (lambda t: "- a list\n", "expected a mapping"),
    (lambda t: "devices_per_node: [\n", "not valid YAML"),
])
def test_bad_files_name_the_file_and_the_field(tmp_path, edit, message):
    path = write(tmp_path, edit(GOOD))
    with pytest.raises(ValueError, match=message) as error:
        load_hardware(path)
    assert str(path) in str(error.value)


def test_unknown_file_lists_the_shipped_names():
    with pytest.raises(FileNotFoundError, match="p3.16xlarge"):
        load_hardware("no-such-cluster")


def _detect(rank, world_size):
    return detect_hardware(repeats=2)


def _detect_bound(rank, world_size):
    bind_cores(rank, world_size)
    return detect_hardware(repeats=1)


def test_ranks_bound_to_their_cores_still_count_the_whole_node():
    specs = run_ranks(2, _detect_bound)
    assert specs[0].compute_slots_per_node == len(os.sched_getaffinity(0))


def test_detect_hardware_over_two_gloo_ranks():
    import psutil
    specs = run_ranks(2, _detect)
    assert specs[0] == specs[1]  # every rank gets the same answer
    spec = specs[0]
    assert (spec.devices_per_node, spec.nodes) == (2, 1)
    assert spec.memory_per_device_bytes == pytest.approx(psutil.virtual_memory().total / 2)
    assert spec.intra_node_bandwidth > 0 and spec.intra_node_latency_s > 0
    assert set(spec.peak_flops) == {"float32", "float16", "bfloat16"}
    assert all(v > 0 for v in spec.peak_flops.values()) and spec.memory_bandwidth > 0
    assert spec.efficiency == 1.0  # measured rates are achieved rates
    assert spec.device_type == "cpu"
    assert spec.kernel_overhead_s > 0
    assert spec.compute_slots_per_node == len(os.sched_getaffinity(0))  # CPU ranks share cores
    # all-reduce times of the 2-rank group, one per probed size
    assert [(g, b) for g, b, _ in spec.allreduce_times] == [(2, b) for b in ALLREDUCE_PROBE_BYTES]
    assert all(t > 0 for _, _, t in spec.allreduce_times)
    # the extra of an all-reduce after compute, one per probed segment
    assert [s for s, _ in spec.allreduce_after_compute] == list(AFTER_COMPUTE_SEGMENTS_S)
    assert all(extra >= 0 for _, extra in spec.allreduce_after_compute)
    assert spec.p2p_processor_s >= 0  # per message (its arithmetic: the test below)


COMPUTE_S, SEND_S = 1e-3, 2e-4  # virtual processor seconds of a compute segment and of a send


def _p2p_processor(rank, world_size):
    """The probe on a virtual processor clock: a compute segment costs COMPUTE_S, a send SEND_S
    more (the real transfers still run), so a message costs SEND_S / 2 beyond the computation
    (one send and one receive per round)."""
    clock = VirtualClock()
    real_batch = dist.batch_isend_irecv

    def costly_batch(ops):
        clock.advance(SEND_S * sum(op.op is dist.isend for op in ops))
        return real_batch(ops)
    with installed(clock, hardware):
        hardware._compute_segment = lambda: (lambda: clock.advance(COMPUTE_S))
        hardware.dist.batch_isend_irecv = costly_batch
        try:
            return probe_p2p_processor_time(rounds=4, repeats=3)
        finally:
            hardware.dist.batch_isend_irecv = real_batch


@pytest.mark.parametrize("world", [2, 3])  # with 3, the last rank has no partner and computes
def test_the_processor_time_of_pipeline_messages(world):
    values = run_ranks(world, _p2p_processor)
    assert all(value == values[0] for value in values)  # every rank gets the same answer
    assert values[0] == pytest.approx(SEND_S / 2)  # the computation itself is not counted
    assert run_ranks(1, _p2p_processor) == [0.0]  # nobody to exchange with


def _after_compute(rank, world_size, processors):
    """The probe on a virtual clock: the compute before a call advances it by the segment and a
    4-byte all-reduce by 0.1 ms whatever came before it."""
    clock = VirtualClock()
    with _allreduces_taking(clock, 1, lambda call: 1e-4), installed(clock, hardware, "busy_wait"):
        return probe_allreduce_after_compute(segments_s=(2e-4, 3e-2), calls=3, rounds=1,
                                             processors=processors)


def test_allreduce_after_compute_with_one_rank_per_processor():
    tables = run_ranks(3, _after_compute, 2)  # ranks 0 and 1 take part, rank 2 waits
    assert all(table == tables[0] for table in tables)  # every rank gets the same table
    assert [s for s, _ in tables[0]] == [2e-4, 3e-2]
    # the busy-wait itself is not counted: that would put the 30 ms segment's extra at 30 ms
    nothing = pytest.approx(0.0, abs=1e-12)
    assert tables[0] == ((2e-4, nothing), (3e-2, nothing))
    assert run_ranks(2, _after_compute, 1) == [(), ()]  # one processor: nobody to meet


def test_extra_after_compute_is_interpolated_in_the_segment(tmp_path):
    import dataclasses
    spec = dataclasses.replace(load_hardware(write(tmp_path, GOOD)),
                               allreduce_after_compute=((0.004, 1e-3), (0.001, 4e-4)))
    assert spec.allreduce_after_compute_s(0.0) == 0.0
    assert spec.allreduce_after_compute_s(0.0005) == pytest.approx(2e-4)  # from 0 after none
    assert spec.allreduce_after_compute_s(0.001) == pytest.approx(4e-4)
    assert spec.allreduce_after_compute_s(0.0025) == pytest.approx(7e-4)
    assert spec.allreduce_after_compute_s(0.01) == pytest.approx(1e-3)  # beyond: the last
    assert load_hardware(write(tmp_path, GOOD)).allreduce_after_compute_s(0.002) == 0.0


def _allreduce_table(rank, world_size):
    return probe_allreduce_times(sizes=(4, 1 << 16), repeats=4)


def test_allreduce_times_for_every_group_size_of_a_node():
    tables = run_ranks(4, _allreduce_table)
    assert all(table == tables[0] for table in tables)  # every rank gets the same tables
    times, processor = tables[0]
    assert [(g, b) for g, b, _ in times] == [(2, 4), (2, 1 << 16), (4, 4), (4, 1 << 16)]
    assert all(t > 0 for _, _, t in times)
    # CPU ranks: the processor seconds of the same calls, beside them
    assert [(g, b) for g, b, _ in processor] == [(g, b) for g, b, _ in times]
    # a rank's threads use at most its processors in each timed run, so the medians keep that bound
    cores = len(os.sched_getaffinity(0))
    assert all(0 < p <= cores * t for (_, _, t), (_, _, p) in zip(times, processor))


TAIL_BYTES, TAIL_EVERY, FAST_S, SLOW_S = 128 << 10, 50, 1e-4, 10e-3


@contextlib.contextmanager
def _allreduces_taking(clock, numel, seconds_of_call):
    """All-reduces of `numel` elements advance the virtual clock by seconds_of_call(k) for the
    k-th call (from 1) instead of being timed; others (the probes' own exchanges of their results)
    run as they are."""
    real, calls = dist.all_reduce, [0]

    def timed_by_the_clock(tensor, *args, **kwargs):
        if tensor.numel() != numel:
            return real(tensor, *args, **kwargs)
        calls[0] += 1
        clock.advance(seconds_of_call(calls[0]))

    dist.all_reduce = timed_by_the_clock
    try:
        yield
    finally:
        dist.all_reduce = real


def _long_tail(call):
    """FAST_S except every TAIL_EVERY-th call, SLOW_S (gloo's 128 KB all-reduces here: 0.2 ms,
    and 1-7 ms about one in six)."""
    return SLOW_S if call % TAIL_EVERY == 0 else FAST_S


def _allreduce_with_a_long_tail(rank, world_size):
    """The probe's time for 128 KB all-reduces with a long tail, on a virtual clock."""
    clock = VirtualClock()
    with _allreduces_taking(clock, TAIL_BYTES // 4, _long_tail), installed(clock, hardware):
        times, _ = probe_allreduce_times(sizes=(TAIL_BYTES,))
    return times[0][2]


def test_the_allreduce_probe_reads_the_mean_of_a_long_tail():
    """Training pays an all-reduce's mean time, slow calls included: a timed run must be long
    enough to hold them (runs of 20 calls here would hold 0 or 1 slow call and read a median of
    0.1 ms against a mean of 0.3)."""
    mean = FAST_S + (SLOW_S - FAST_S) / TAIL_EVERY
    measured = run_ranks(2, _allreduce_with_a_long_tail)
    assert measured[0] == pytest.approx(mean, rel=0.05)


def _after_compute_with_a_long_tail(rank, world_size):
    """The after-compute probe's extras for 4-byte all-reduces with a long tail whatever came
    before them, on a virtual clock: the same mean after compute as back to back."""
    clock = VirtualClock()
    with _allreduces_taking(clock, 1, _long_tail), installed(clock, hardware, "busy_wait"):
        return probe_allreduce_after_compute()


def test_the_after_compute_probe_is_long_enough_for_a_long_tail():
    """Rare slow calls must not land in one segment's calls and not another's, or the table
    reads their share as an extra after that much compute (with 20 calls a round, the slow calls
    here fall into some segments only: 0.5 ms extra for them, none for the rest)."""
    table = run_ranks(2, _after_compute_with_a_long_tail)[0]
    assert [s for s, _ in table] == list(AFTER_COMPUTE_SEGMENTS_S)
    assert all(extra < 0.05 * (SLOW_S - FAST_S) / TAIL_EVERY for _, extra in table), table


def _slice_on_a_virtual_clock(rank, world_size, turn_reads):
    """Every clock read takes 1 us; this rank loses its turn for 5 ms after every `turn_reads[rank]`
    reads (None: never)."""
    clock, reads = VirtualClock(), [0]

    def read():
        reads[0] += 1
        lost = turn_reads[rank] and reads[0] % turn_reads[rank] == 0
        clock.advance(5e-3 if lost else 1e-6)
        return clock.now
    module = clock.as_time_module()
    module.perf_counter = read
    saved, hardware.time = hardware.time, module
    try:
        return probe_scheduler_slice(seconds=0.1)
    finally:
        hardware.time = saved


def test_the_scheduler_slice_is_the_mean_over_ranks_of_their_median_run():
    # a run spans the reads between two lost turns: n - 1 steps of 1 us (the first run n - 2)
    slices = run_ranks(2, _slice_on_a_virtual_clock, [1000, 3000])
    assert slices[0] == slices[1]  # every rank gets the same answer
    assert slices[0] == pytest.approx((999e-6 + 2999e-6) / 2)
    # a rank that never lost a turn counts for nothing; with none, no slice
    assert run_ranks(2, _slice_on_a_virtual_clock, [1000, None])[0] == pytest.approx(999e-6)
    assert run_ranks(2, _slice_on_a_virtual_clock, [None, None]) == [None, None]


def test_a_detected_cpu_node_with_more_ranks_than_cores_has_a_slice():
    specs = run_ranks(len(os.sched_getaffinity(0)) + 1, _detect)
    assert specs[0].compute_slots_per_node < specs[0].devices_per_node
    assert specs[0].scheduler_slice_s > 0  # measured: ranks that share a core lose turns


def test_the_median_of_several_detections(tmp_path):
    import dataclasses
    base = dataclasses.replace(load_hardware(write(tmp_path, GOOD)), scheduler_slice_s=0.004,
                               allreduce_times=((2, 4, 1e-3), (2, 1024, 2e-3)),
                               allreduce_processor_times=((2, 4, 5e-4), (2, 1024, 1e-3)),
                               allreduce_after_compute=((1e-3, 2e-4),), p2p_processor_s=1e-3)
    specs = [dataclasses.replace(base, intra_node_bandwidth=base.intra_node_bandwidth * k,
                                 peak_flops={d: f * k for d, f in base.peak_flops.items()},
                                 scheduler_slice_s=0.004 * k, p2p_processor_s=1e-3 * k,
                                 allreduce_times=tuple((g, b, t * k)
                                                       for g, b, t in base.allreduce_times),
                                 allreduce_processor_times=tuple(
                                     (g, b, t * k) for g, b, t in base.allreduce_processor_times),
                                 allreduce_after_compute=((1e-3, 2e-4 * k),))
             for k in (1.0, 3.0, 2.0)]
    middle = HardwareSpec.median(specs)
    assert middle.intra_node_bandwidth == pytest.approx(2 * base.intra_node_bandwidth)
    assert middle.peak_flops["float32"] == pytest.approx(2 * base.peak_flops["float32"])
    assert middle.scheduler_slice_s == pytest.approx(0.008)
    assert middle.p2p_processor_s == pytest.approx(2e-3)
    assert middle.allreduce_times == ((2, 4, pytest.approx(2e-3)), (2, 1024, pytest.approx(4e-3)))
    assert middle.allreduce_processor_times == ((2, 4, pytest.approx(1e-3)),
                                                (2, 1024, pytest.approx(2e-3)))
    assert middle.allreduce_after_compute == ((1e-3, pytest.approx(4e-4)),)
    assert (middle.name, middle.devices_per_node, middle.memory_bandwidth) == \
        (base.name, base.devices_per_node, base.memory_bandwidth)


def test_the_link_probe_times_a_warmed_up_pair(monkeypatch):
    """A pair's first round trips run slow (gloo here: 1.9 ms against 0.1 ms once warm), so they
    are not timed: only round trips after the warm-up enter the median."""
    import torch
    import torch.distributed as dist
    sends = []
    slow = hardware.PAIR_WARMUP_ROUND_TRIPS  # the first round trips take 50 ms each, later 1 ms
    clock = VirtualClock()
    monkeypatch.setattr(hardware, "time", clock.as_time_module())
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "send", lambda tensor, peer, group=None: sends.append(peer))
    monkeypatch.setattr(dist, "recv", lambda tensor, peer, group=None:
                        clock.advance(0.05 if len(sends) <= slow else 1e-3))
    seconds = hardware._one_way_time(None, 0, 1, 4, torch.device("cpu"), repeats=5)
    assert len(sends) == slow + 1 + 5  # warm-up, median_time's own warm-up run, 5 timed
    assert seconds == pytest.approx(0.5e-3)  # a slow round trip timed would make it 0.025
