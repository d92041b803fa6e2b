"""What the planner knows about a cluster: `HardwareSpec`, read from a YAML file or measured here.

Units are SI base units throughout (bytes, bytes/s, seconds, FLOP/s). YAML values may carry a unit
("16 GiB", "300 GB/s", "25 Gbit/s", "10 us", "125 TFLOPS") or be plain numbers in base units.

Link model (what the cost model assumes):
- `intra_node_bandwidth`: one direction, between two devices of a node (what a p2p copy reaches).
  Collectives inside a node are rings over such links.
- `inter_node_bandwidth`: one direction, everything one node can send to other nodes (the sum over
  its NICs). Flows leaving a node at the same time share it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from megatron_2bw.distributed.launch import usable_cores

SHIPPED_DIR = Path(__file__).with_name("hardware")
DTYPES = ("float32", "float16", "bfloat16")

_UNITS = {
    "bytes": {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
              "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40},
    "bandwidth": {"b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
                  "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,
                  "tbit/s": 1e12 / 8},
    "seconds": {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9},
    "flops": {"flops": 1, "gflops": 1e9, "tflops": 1e12, "pflops": 1e15},
    "fraction": {"%": 0.01},
}


def _interpolated(table: tuple[tuple[int, int, float], ...], group_size: int,
                  nbytes: float) -> float | None:
    """A (group size, bytes, seconds) table's figure for `nbytes`, linear in log bytes between the
    measured sizes; beyond them the end point scaled by bytes (large) or the smallest (small);
    None when the group size was not measured."""
    points = sorted((b, t) for n, b, t in table if n == group_size)
    if not points:
        return None
    nbytes = max(float(nbytes), 1.0)
    if nbytes <= points[0][0]:
        return points[0][1]
    if nbytes >= points[-1][0]:
        return points[-1][1] * nbytes / points[-1][0]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if b0 <= nbytes <= b1:
            w = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return t0 + w * (t1 - t0)
    return points[-1][1]


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    devices_per_node: int
    nodes: int
    memory_per_device_bytes: float
    intra_node_bandwidth: float
    intra_node_latency_s: float
    inter_node_bandwidth: float
    inter_node_latency_s: float
    peak_flops: dict[str, float]  # per device, dense, by working dtype name
    memory_bandwidth: float  # device memory bytes/s (memory-bound kernels)
    efficiency: float = 0.4  # fraction of peak FLOP/s and memory bandwidth kernels achieve
    reserved_memory_bytes: float = 0.0  # held outside the framework: CUDA context, NCCL buffers
    kernel_overhead_s: float = 0.0  # fixed cost of each kernel launch (launch latency, tail)
    source: str = ""
    # latency per ring hop of a small all-reduce inside a node, when measured (detect_hardware):
    # a library's all-reduce of a few bytes is not 2(n-1) sequential p2p messages (gloo on 2 CPU
    # ranks: 0.23 ms against a 0.74 ms p2p half round trip). None: intra_node_latency_s.
    collective_hop_latency_s: float | None = None
    # processors that run a node's ranks at the same time: None means one per device (GPUs);
    # CPU ranks share the node's cores, so more ranks than cores take turns (detect_hardware)
    compute_slots_per_node: int | None = None
    # measured all-reduce times inside a node, when detected: ((group size, bytes, seconds), ...),
    # the mean of back-to-back all-reduces with every group of that size of the node busy at once.
    # A library's collective is not latency + bytes / bandwidth in between (gloo on this 2-core
    # machine: 0.3 ms for 4 B, 7 ms for 8 MB, but 2 ms for 128 KB), so the cost model interpolates.
    allreduce_times: tuple[tuple[int, int, float], ...] = ()
    # processor seconds one rank spends per all-reduce of allreduce_times (all its threads, the
    # kernel's socket copies included), measured on CPU ranks: gloo reduces on the cores the ranks
    # compute on, so where ranks share cores it counts in the node's processor budget. On this VM
    # 40-80% of the wall time for 2-rank groups of 4 ranks on 2 cores, 35-50% for the 4-rank group.
    allreduce_processor_times: tuple[tuple[int, int, float], ...] = ()
    # nodes running more ranks than processors: how long the OS runs a computing rank before
    # another takes its turn (Linux on this VM: 3.9 ms). A rank woken in a transfer or collective
    # while other ranks of its node compute waits for its peers' turns (cost.Network.wake_s).
    scheduler_slice_s: float | None = None
    # the extra time of a blocking all-reduce that follows compute on every rank of its group,
    # when measured (detect_hardware on CPU ranks): ((compute segment seconds, extra seconds over
    # back to back), ...). On this VM 0-1.9 ms after 0.5-5 ms of compute: the ranks come out of
    # compute apart (benchmarks/collective_after_compute.py), which back-to-back times never see.
    allreduce_after_compute: tuple[tuple[float, float], ...] = ()
    # processor time a CPU rank spends per pipeline message it sends or receives, beyond the
    # transfer itself: gloo's loop thread, the wake-up, and compute slowed by the switch (its
    # caches refilled); 0 where that is not measured (devices compute while the host waits). On
    # this VM 0.75-0.85 ms with a core per rank and 0.9-1 ms with 4 ranks on 2 cores, against
    # 10-30 ms of compute per microbatch in the planner validation's pipelines.
    p2p_processor_s: float = 0.0
    # "cuda" or "cpu": which attention kernels run (planner.memory.fused_attention)
    device_type: str = "cuda"

    def __hash__(self) -> int:  # peak_flops is a dict; specs key the planner's caches
        return hash((self.name, self.devices_per_node, self.nodes, self.memory_per_device_bytes,
                     self.intra_node_bandwidth, self.inter_node_bandwidth,
                     tuple(sorted(self.peak_flops.items())), self.memory_bandwidth, self.efficiency,
                     self.compute_slots_per_node, self.allreduce_times, self.scheduler_slice_s,
                     self.allreduce_after_compute, self.p2p_processor_s,
                     self.allreduce_processor_times, self.device_type))

    def measured_allreduce_s(self, group_size: int, nbytes: float) -> float | None:
        """Interpolated (linearly in log bytes) measured all-reduce time of a group of that size
        inside a node; None when none was measured. Beyond the measured sizes: the end point
        scaled by bytes (large) or the smallest time (small)."""
        return _interpolated(self.allreduce_times, group_size, nbytes)

    def allreduce_processor_s(self, group_size: int, nbytes: float) -> float:
        """Processor seconds a rank spends per all-reduce of that size, interpolated like the
        times (0 where not measured: devices, or hardware files)."""
        return _interpolated(self.allreduce_processor_times, group_size, nbytes) or 0.0

    def allreduce_after_compute_s(self, segment_s: float) -> float:
        """Extra time of a blocking all-reduce after `segment_s` of compute on every rank of the
        group: linear in the segment between the measured ones (and from 0 after no compute);
        beyond the longest measured segment, its figure. 0 when not measured."""
        points = [(0.0, 0.0), *sorted(self.allreduce_after_compute)]
        if segment_s >= points[-1][0]:
            return points[-1][1]
        (s0, e0), (s1, e1) = next(pair for pair in zip(points, points[1:])
                                   if segment_s <= pair[1][0])
        return e0 + (segment_s - s0) / (s1 - s0) * (e1 - e0)

    @property
    def compute_slots(self) -> int:
        return self.compute_slots_per_node or self.devices_per_node

    def shares_processors(self, world_size: int) -> bool:
        """Whether a node of a `world_size`-rank job runs more ranks than it has processors."""
        return min(world_size, self.devices_per_node) > self.compute_slots

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_per_device_bytes - self.reserved_memory_bytes

    def flops_for(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"hardware {self.name!r} gives no peak_flops for {dtype} (it has "
                             f"{sorted(self.peak_flops)})")
        return self.peak_flops[dtype]

    @staticmethod
    def median(specs: list["HardwareSpec"]) -> "HardwareSpec":
        """Several detections of one machine as one: each measured figure the median of the
        detections (the first detection's name, counts and source)."""
        first = specs[0]

        def middle(values):
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None
        measured = {f.name: middle(getattr(s, f.name) for s in specs)
                    for f in dataclasses.fields(HardwareSpec)
                    if isinstance(getattr(first, f.name), float)}
        flops = {dtype: middle(s.peak_flops[dtype] for s in specs) for dtype in first.peak_flops}

        def middle_table(name: str) -> tuple:
            """Per key (the entry's leading fields), the median of the last field."""
            return tuple((*key, middle(entry[-1] for s in specs for entry in getattr(s, name)
                                       if tuple(entry[:-1]) == tuple(key)))
                         for *key, _ in getattr(first, name))
        tables = ("allreduce_times", "allreduce_processor_times", "allreduce_after_compute")
        return dataclasses.replace(first, **measured, peak_flops=flops,
                                   **{name: middle_table(name) for name in tables})

    def for_world(self, world_size: int) -> "HardwareSpec":
        """The same hardware with as many nodes as `world_size` devices need."""
        if world_size < 1:
            raise ValueError(f"world size must be positive, got {world_size}")
        return dataclasses.replace(self, nodes=-(-world_size // self.devices_per_node))


# ---------------------------------------------------------------------------------------------
# YAML files

_REQUIRED = {"devices_per_node": "count", "memory_per_device": "bytes",
             "intra_node_bandwidth": "bandwidth", "intra_node_latency": "seconds",
             "inter_node_bandwidth": "bandwidth", "inter_node_latency": "seconds",
             "peak_flops": "flops", "memory_bandwidth": "bandwidth"}
_OPTIONAL = {"name": "text", "nodes": "count", "efficiency": "fraction",
             "reserved_memory": "bytes", "kernel_overhead": "seconds", "source": "text",
             "compute_slots_per_node": "count", "scheduler_slice": "seconds",
             "p2p_processor_time": "seconds", "device": "device"}
DEVICE_TYPES = ("cuda", "cpu")


def parse_quantity(value, kind: str, where: str) -> float:
    """A number, or a string "<number> <unit>" with a unit of `kind`; errors name `where`."""
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected a {kind} quantity, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a {kind} quantity, got {value!r}")
    match = re.fullmatch(r"\s*([-+0-9.eE]+)\s*([A-Za-zµ/%]*)\s*", value)
    try:
        number = float(match.group(1)) if match else None
    except ValueError:
        number = None
    if number is None:
        raise ValueError(f"{where}: cannot read {value!r} as a {kind} quantity")
    unit = match.group(2).lower().replace("bps", "bit/s")
    if not unit:
        return number
    if unit not in _UNITS[kind]:
        raise ValueError(f"{where}: unknown {kind} unit {match.group(2)!r} in {value!r}; expected "
                         f"one of {', '.join(_UNITS[kind])}")
    return number * _UNITS[kind][unit]


def _field(raw: dict, key: str, kind: str, where: str):
    value = raw[key]
    if kind == "text":
        return str(value)
    if kind == "device":
        if value not in DEVICE_TYPES:
            raise ValueError(f"{where}: {key} must be one of {', '.join(DEVICE_TYPES)}, got "
                             f"{value!r}")
        return value
    if kind == "count":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
        return value
    if kind == "fraction":
        number = parse_quantity(value, "fraction", f"{where}: {key}")
        if not 0 < number <= 1:
            raise ValueError(f"{where}: {key} must be in (0, 1], got {value!r}")
        return number
    if kind == "flops":
        if not isinstance(value, dict) or not value:
            raise ValueError(f"{where}: peak_flops must map dtypes ({', '.join(DTYPES)}) to FLOP/s, "
                             f"got {value!r}")
        unknown = set(value) - set(DTYPES)
        if unknown:
            raise ValueError(f"{where}: peak_flops has unknown dtype(s) {sorted(unknown)}; expected "
                             f"{', '.join(DTYPES)}")
        return {dtype: _positive(parse_quantity(v, "flops", f"{where}: peak_flops.{dtype}"),
                                 f"{where}: peak_flops.{dtype}") for dtype, v in value.items()}
    number = parse_quantity(value, kind, f"{where}: {key}")
    if number < 0 or (number == 0 and kind != "seconds"):
        raise ValueError(f"{where}: {key} must be positive, got {value!r}")
    return number


def _positive(number: float, where: str) -> float:
    if number <= 0:
        raise ValueError(f"{where} must be positive, got {number}")
    return number


def shipped_hardware() -> list[str]:
    return sorted(path.stem for path in SHIPPED_DIR.glob("*.yaml"))


def load_hardware(path_or_name: str | os.PathLike) -> HardwareSpec:
    """Read a hardware YAML file, or a shipped one by name (e.g. "p3.16xlarge")."""
    path = Path(path_or_name)
    if not path.exists() and (SHIPPED_DIR / f"{path_or_name}.yaml").exists():
        path = SHIPPED_DIR / f"{path_or_name}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"hardware file {str(path_or_name)!r} not found (shipped names: "
                                f"{', '.join(shipped_hardware())})")
    where = str(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(f"{where}: not valid YAML ({error})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping of hardware fields, got {type(raw).__name__}")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = [key for key in raw if key not in _REQUIRED and key not in _OPTIONAL]
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}; expected "
                         f"{', '.join([*_REQUIRED, *_OPTIONAL])}")
    values = {key: _field(raw, key, kind, where) for key, kind in {**_REQUIRED, **_OPTIONAL}.items()
              if key in raw}
    return HardwareSpec(
        name=values.get("name", path.stem), devices_per_node=values["devices_per_node"],
        nodes=values.get("nodes", 1), memory_per_device_bytes=values["memory_per_device"],
        intra_node_bandwidth=values["intra_node_bandwidth"],
        intra_node_latency_s=values["intra_node_latency"],
        inter_node_bandwidth=values["inter_node_bandwidth"],
        inter_node_latency_s=values["inter_node_latency"], peak_flops=values["peak_flops"],
        memory_bandwidth=values["memory_bandwidth"], efficiency=values.get("efficiency", 0.4),
        reserved_memory_bytes=values.get("reserved_memory", 0.0),
        kernel_overhead_s=values.get("kernel_overhead", 0.0), source=values.get("source", where),
        compute_slots_per_node=values.get("compute_slots_per_node"),
        scheduler_slice_s=values.get("scheduler_slice"),
        p2p_processor_s=values.get("p2p_processor_time", 0.0),
        device_type=values.get("device", "cuda"))


# ---------------------------------------------------------------------------------------------
# Detection on the machine at hand (collective: every rank of the group calls these; every rank
# gets the same answer)

@dataclass(frozen=True)
class LinkProbe:
    """Measured over the job's ranks; the inter-node fields are None in a single-node job."""
    intra_node_bandwidth: float | None  # None: no node holds two ranks
    intra_node_latency_s: float | None
    inter_node_bandwidth: float | None
    inter_node_latency_s: float | None
    allreduce_bytes: int
    allreduce_s: float  # one all-reduce of allreduce_bytes over the whole group
    small_allreduce_s: float  # one all-reduce of 4 bytes over the whole group
    ranks_per_node: tuple[int, ...]


def _device_for(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def timed_call(fn, device: torch.device, setup=None) -> float:
    """Wall time of one fn() (synchronising the device); `setup()`, if given, runs untimed first."""
    if setup is not None:
        setup()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def median_time(fn, device: torch.device, repeats: int, setup=None) -> float:
    """Median wall time of fn() over `repeats` runs after a warm-up run (synchronising the device);
    `setup()`, if given, runs untimed before each."""
    timed_call(fn, device, setup)
    return sorted(timed_call(fn, device, setup) for _ in range(repeats))[repeats // 2]


def _agree(values: list[float], op, group, device) -> list[float]:
    """The same numbers on every rank: an all-reduce (MIN, MAX) of each rank's measurements."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def _host_names(group) -> list[str]:
    """Every group rank's host name, by group rank. Collective."""
    hosts: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts


# a pair's first round trips run slow (gloo here: a 4-byte half round trip took 1.9 ms for the
# first few, 0.07-0.12 ms after), so the probe times a warmed-up pair, as training meets it
PAIR_WARMUP_ROUND_TRIPS = 10


def _one_way_time(group, a: int, b: int, nbytes: int, device, repeats: int) -> float:
    """Half a round trip of nbytes between group ranks a and b (0 on the other ranks)."""
    me = dist.get_rank(group)
    if me not in (a, b):
        return 0.0
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    peer = dist.get_global_rank(group, b if me == a else a)

    def round_trip():
        if me == a:
            dist.send(buffer, peer, group=group)
            dist.recv(buffer, peer, group=group)
        else:
            dist.recv(buffer, peer, group=group)
            dist.send(buffer, peer, group=group)
    for _ in range(PAIR_WARMUP_ROUND_TRIPS):
        round_trip()
    return median_time(round_trip, device, repeats) / 2


def _link(group, pair: list[int] | None, device, repeats: int, large: int
          ) -> tuple[float | None, float | None]:
    """(bandwidth, latency) between a pair of ranks from a 4-byte and a large message."""
    if pair is None:
        return None, None
    small_s = _one_way_time(group, *pair, 4, device, repeats)
    large_s = _one_way_time(group, *pair, large, device, repeats)
    small_s, large_s = _agree([small_s, large_s], dist.ReduceOp.MAX, group, device)
    return (large - 4) / max(large_s - small_s, 1e-9), small_s


def probe_links(group=None, repeats: int = 5, large_bytes: int = 8 << 20) -> LinkProbe:
    """p2p bandwidth and latency between two ranks of a node and of two nodes (hosts), and the
    time of one all-reduce over the group."""
    group = group or dist.group.WORLD
    device = _device_for(group)
    size = dist.get_world_size(group)
    hosts = _host_names(group)
    ranks_of_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks_of_host.setdefault(host, []).append(rank)
    same_node = next((ranks[:2] for ranks in ranks_of_host.values() if len(ranks) > 1), None)
    other_node = next(([0, r] for r in range(size) if hosts[r] != hosts[0]), None)
    intra = _link(group, same_node, device, repeats, large_bytes)
    inter = _link(group, other_node, device, repeats, large_bytes)
    tensor = torch.ones(large_bytes // 4, dtype=torch.float32, device=device)
    allreduce_s = median_time(lambda: dist.all_reduce(tensor, group=group), device, repeats)
    small = torch.ones(1, dtype=torch.float32, device=device)
    small_s = median_time(lambda: dist.all_reduce(small, group=group), device, 4 * repeats + 1)
    allreduce_s, small_s = _agree([allreduce_s, small_s], dist.ReduceOp.MAX, group, device)
    return LinkProbe(*intra, *inter, large_bytes, allreduce_s, small_s,
                     tuple(len(ranks) for ranks in ranks_of_host.values()))


ALLREDUCE_PROBE_BYTES = (4, 16 << 10, 128 << 10, 1 << 20, 8 << 20)


def probe_allreduce_times(group=None, sizes=ALLREDUCE_PROBE_BYTES, repeats: int = 100
                          ) -> tuple[tuple[tuple[int, int, float], ...], ...]:
    """Mean seconds of back-to-back all-reduces per (group size, bytes), for every group size g
    >= 2 dividing the ranks of a node, with the node's consecutive g-rank groups all busy at once
    (as tensor-parallel groups are); and, on CPU ranks, the processor seconds a rank spent per
    all-reduce meanwhile (all its threads; an empty table on devices). Collective: every rank
    calls it; all get the same tables. Single-node jobs only (empty tables otherwise: the link
    model applies).

    Each timed run makes `repeats` calls (a quarter of that above 1 MB) because the times can
    have a long tail (on CPU, gloo finishes most small all-reduces quickly and a few ten times
    slower), which a short run samples badly."""
    group = group or dist.group.WORLD
    device = _device_for(group)
    size = dist.get_world_size(group)
    hosts = _host_names(group)
    if size < 2 or len(set(hosts)) > 1:
        return (), ()
    ranks = [dist.get_global_rank(group, r) for r in range(size)]
    table = []
    for g in (n for n in range(2, size + 1) if size % n == 0):
        subgroups = [dist.new_group(ranks[i:i + g]) if g < size else group
                     for i in range(0, size, g)]
        mine = subgroups[dist.get_rank(group) // g]
        for nbytes in sizes:
            tensor = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
            count = max(2, repeats if nbytes <= (1 << 20) else repeats // 4)
            dist.all_reduce(tensor, group=mine)  # warm-up (connections, buffers)
            spent: list[float] = []  # processor seconds of each run of calls()

            def calls() -> None:
                start = time.process_time()
                for _ in range(count):
                    dist.all_reduce(tensor, group=mine)
                spent.append(time.process_time() - start)
            seconds = median_time(calls, device, 3) / count
            # the median of the timed runs, as for the wall time: one run whose calls spun for
            # a millisecond would dominate a mean (and put it above the processors' bound)
            processor = statistics.median(spent[1:]) / count  # spent[0]: median_time's warm-up
            table.append((g, nbytes, seconds, processor))
        dist.barrier(group=group)
        if mine is not group:  # its gloo threads would otherwise live on through training
            dist.destroy_process_group(mine)
    agreed = _agree([x for *_, t, processor in table for x in (t, processor)],
                    dist.ReduceOp.MAX, group, device)
    times = tuple((g, b, t) for (g, b, *_), t in zip(table, agreed[0::2]))
    processor = tuple((g, b, p) for (g, b, *_), p in zip(table, agreed[1::2]))
    return times, (processor if device.type == "cpu" else ())


AFTER_COMPUTE_SEGMENTS_S = (0.5e-3, 1e-3, 2e-3, 5e-3)


def busy_wait(seconds: float) -> None:
    """Keep this thread's processor busy for `seconds` (compute of a known length)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def probe_allreduce_after_compute(group=None, segments_s=AFTER_COMPUTE_SEGMENTS_S,
                                  calls: int = 100, rounds: int = 3, processors: int | None = None
                                  ) -> tuple[tuple[float, float], ...]:
    """((segment seconds, extra seconds), ...): how much longer a 4-byte all-reduce takes when
    every rank computes (busy-waits) for the segment right before it than back to back; the mean
    over `calls` x `rounds` calls and the ranks (negative differences count as 0). Segments and
    the back-to-back case are interleaved. Gloo's long tail (probe_allreduce_times) needs many
    calls: four probes of 2 ranks here read 0.13-0.45 ms after 1 ms of compute with 20 calls a
    round, 0.32-0.57 with 100 (about 4 s). One rank per processor takes part (the first
    `processors` ranks; turns on shared processors are the replay's processor sharing).
    Collective; single-node jobs only (an empty table otherwise, and with one rank)."""
    group = group or dist.group.WORLD
    device = _device_for(group)
    size = dist.get_world_size(group)
    if size < 2 or len(set(_host_names(group))) > 1:
        return ()
    taking_part = min(size, processors or size)
    if taking_part < 2:
        return ()
    ranks = [dist.get_global_rank(group, r) for r in range(size)]
    mine = group if taking_part == size else dist.new_group(ranks[:taking_part])
    sums = [0.0] * (len(segments_s) + 1)
    if dist.get_rank(group) < taking_part:
        small = torch.zeros(1, device=device)
        for _ in range(3):
            dist.all_reduce(small, group=mine)
        for _ in range(rounds):
            for i, segment in enumerate((0.0, *segments_s)):
                dist.barrier(group=mine)
                for _ in range(calls):
                    busy_wait(segment)
                    start = time.perf_counter()
                    dist.all_reduce(small, group=mine)
                    sums[i] += time.perf_counter() - start
    dist.barrier(group=group)
    if mine is not group:
        dist.destroy_process_group(mine)
    means = [total / (calls * rounds * taking_part)
             for total in _agree(sums, dist.ReduceOp.SUM, group, device)]
    return tuple((segment, max(0.0, mean - means[0]))
                 for segment, mean in zip(segments_s, means[1:]))


def probe_scheduler_slice(group=None, seconds: float = 0.4) -> float | None:
    """How long the OS lets a computing rank run before another rank sharing its processor takes
    its turn: every rank spins for `seconds`, and a gap of over 50 us between two clock reads
    marks a turn lost; the median uninterrupted run, averaged over the ranks. None when no rank
    lost a turn (a processor per rank). Collective; meaningful where ranks share processors."""
    group = group or dist.group.WORLD
    device = _device_for(group)
    runs: list[float] = []
    dist.barrier(group=group)
    start = last = run_start = time.perf_counter()
    while last - start < seconds:
        now = time.perf_counter()
        if now - last > 50e-6:
            runs.append(last - run_start)
            run_start = now
        last = now
    runs.sort()
    mine = [runs[len(runs) // 2], 1.0] if runs else [0.0, 0.0]
    total, preempted = _agree(mine, dist.ReduceOp.SUM, group, device)
    return total / preempted if preempted else None


def _compute_segment(width: int = 512, rows: int = 64):
    """A few milliseconds of one-thread CPU work on a working set of about 2 MB (a two-layer MLP's
    forward and backward): what a rank does between two pipeline messages."""
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(width, width, generator=generator) * 0.01).requires_grad_()
               for _ in range(2)]
    inputs = torch.randn(rows, width, generator=generator)

    def compute() -> None:
        hidden = torch.nn.functional.gelu(inputs @ weights[0])
        (hidden @ weights[1]).sum().backward()
    return compute


def probe_p2p_processor_time(group=None, message_bytes: int = 128 << 10, rounds: int = 30,
                             repeats: int = 5) -> float:
    """Processor seconds (all of a rank's threads) per pipeline message sent or received, beyond
    the computation around it: ranks in pairs (0-1, 2-3, ...), every rank at once, alternate a
    compute segment with one send and one receive (one batch, as the runtime posts an exchange),
    against the same segments without messages; blocks of both interleaved, the median over
    blocks and ranks. Collective; CPU ranks of one node (0 otherwise, and for an odd
    rank without a partner)."""
    group = group or dist.group.WORLD
    device = _device_for(group)
    size = dist.get_world_size(group)
    if device.type != "cpu" or size < 2 or len(set(_host_names(group))) > 1:
        return 0.0
    me = dist.get_rank(group)
    partner = me ^ 1 if (me ^ 1) < size else None
    peer = dist.get_global_rank(group, partner) if partner is not None else None
    compute = _compute_segment()
    outgoing = torch.zeros(max(message_bytes // 4, 1))
    incoming = torch.empty_like(outgoing)

    def exchange_round() -> None:
        compute()
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, peer, group),
                                            dist.P2POp(dist.irecv, incoming, peer, group)]):
            work.wait()

    extras = []
    if partner is not None:
        for _ in range(3):
            exchange_round()
    for _ in range(repeats):
        blocks = []
        for body in (compute, exchange_round if partner is not None else compute):
            dist.barrier(group=group)
            start = time.process_time()
            for _ in range(rounds):
                body()
            blocks.append((time.process_time() - start) / rounds)
        extras.append((blocks[1] - blocks[0]) / 2)  # two messages per exchange round
    gathered: list = [None] * size
    dist.all_gather_object(gathered, extras if partner is not None else [], group=group)
    return max(0.0, statistics.median(value for extras in gathered for value in extras))


def _node_cores(group) -> int:
    """The cores the ranks of the busiest-constrained node may run on: per host the union of its
    ranks' CPU affinities (ranks bound with --bind-cores-to-rank each see only their share), the
    smallest over hosts. Collective."""
    mine = usable_cores()
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (socket.gethostname(), mine), group=group)
    per_host: dict[str, set[int]] = {}
    for host, cores in gathered:
        per_host.setdefault(host, set()).update(cores)
    return min(len(cores) for cores in per_host.values())


def _host_memory_bytes() -> int:
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _measure_compute(device: torch.device) -> tuple[dict[str, float], float, float]:
    """Achieved matmul FLOP/s per dtype, copy bandwidth and the time of a one-element kernel
    (short runs: small matmuls on a CPU, whose half-precision matmuls can be very slow)."""
    n = 256 if device.type == "cpu" else 4096
    flops = {}
    for dtype in DTYPES:
        a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
        flops[dtype] = 2 * n ** 3 / median_time(lambda: a @ a, device, 3)
    source = torch.empty((32 if device.type == "cpu" else 256) << 20, dtype=torch.uint8,
                         device=device)
    target = torch.empty_like(source)
    bandwidth = 2 * source.numel() / median_time(lambda: target.copy_(source), device, 3)
    one = torch.zeros(1, device=device)
    launch = median_time(lambda: [one.add_(1) for _ in range(100)], device, 3) / 100
    return flops, bandwidth, launch


def detect_hardware(group=None, name: str | None = None, repeats: int = 5) -> HardwareSpec:
    """The machine at hand as a HardwareSpec.

    Memory: the device's total memory (CUDA; what the context, NCCL and others hold is
    `reserved_memory_bytes`), or the host's RAM divided by the ranks on the host (CPU), whose
    ranks share the cores they may run on (`compute_slots_per_node`).
    peak_flops and memory_bandwidth are *achieved* rates of a matmul and a copy (the slowest rank's),
    so efficiency is 1. Link figures come from `probe_links`; without a second rank on a node the
    device's copy bandwidth stands in for the intra-node link, and a single-node job reports the
    intra-node figures (times the ranks of a node) for the inter-node link it does not have.
    `repeats` sets the timed runs of the link probe and, times 20, the calls of each all-reduce
    run (100 by default; tests pass fewer).
    """
    group = group or dist.group.WORLD
    device = _device_for(group)
    probe = probe_links(group, repeats)
    ranks_here = max(probe.ranks_per_node)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        memory = float(properties.total_memory)
        reserved = float(total - free - torch.cuda.memory_reserved(device))
        label = properties.name
        slots = None
    else:
        memory, reserved, label = _host_memory_bytes() / ranks_here, 0.0, "cpu"
        slots = _node_cores(group)
    flops, bandwidth, launch = _measure_compute(device)
    slice_s = probe_scheduler_slice(group) if slots is not None and ranks_here > slots else None
    measured = _agree([memory, *flops.values(), bandwidth], dist.ReduceOp.MIN, group, device)
    memory, bandwidth = measured[0], measured[-1]
    flops = dict(zip(flops, measured[1:-1]))
    reserved, launch = _agree([max(reserved, 0.0), launch], dist.ReduceOp.MAX, group, device)
    intra_bw = probe.intra_node_bandwidth or bandwidth
    intra_latency = probe.intra_node_latency_s or 0.0
    hosts = len(probe.ranks_per_node)
    size = dist.get_world_size(group)
    # a ring all-reduce pays 2(n-1) hop latencies; measured over a group within one node only
    hop_latency = probe.small_allreduce_s / (2 * (size - 1)) if size > 1 and hosts == 1 else None
    allreduce_times, allreduce_processor = probe_allreduce_times(group, repeats=20 * repeats)
    return HardwareSpec(
        name=name or f"{socket.gethostname()}-{label}-{hosts}x{ranks_here}".replace(" ", "_"),
        devices_per_node=ranks_here, nodes=hosts, memory_per_device_bytes=memory,
        intra_node_bandwidth=intra_bw, intra_node_latency_s=intra_latency,
        inter_node_bandwidth=probe.inter_node_bandwidth or intra_bw * ranks_here,
        inter_node_latency_s=probe.inter_node_latency_s or intra_latency,
        peak_flops=flops, memory_bandwidth=bandwidth, efficiency=1.0,
        reserved_memory_bytes=reserved, kernel_overhead_s=launch,
        collective_hop_latency_s=hop_latency, compute_slots_per_node=slots,
        allreduce_times=allreduce_times, allreduce_processor_times=allreduce_processor,
        scheduler_slice_s=slice_s,
        allreduce_after_compute=probe_allreduce_after_compute(group, processors=slots)
        if slots is not None else (),
        p2p_processor_s=probe_p2p_processor_time(group) if slots is not None else 0.0,
        device_type=device.type,
        source=f"measured by detect_hardware on {socket.gethostname()} ({dist.get_world_size(group)} "
               f"ranks)")
