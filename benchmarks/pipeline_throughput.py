"""Pipeline throughput: one GPT, one data stream, one global batch, trained in one invocation by
- one process (megatron_2bw, no pipeline), and on 2 processes by
- megatron_2bw's GPipe, PipeDream-Flush, PipeDream-2BW, ZB-H1 and interleaved 1F1B (two chunks per
  rank) schedules (build_stage + run_segment), and
- the peers: torch.distributed.pipelining Schedule1F1B / ScheduleGPipe / ScheduleInterleaved1F1B
  (two chunks per rank) / ScheduleInterleavedZeroBubble (one chunk per rank: ZB-H1) and DeepSpeed's
  PipelineEngine.

    python benchmarks/pipeline_throughput.py --repeats 3 --json results.json --plot throughput.png

Every rank (and the one-process baseline) runs with torch.set_num_threads(1), and rank r of every
run (peers included) is bound to core r (--no-bind-cores leaves them to the scheduler). The
configurations are interleaved (each once per round, each round in its own seeded random order,
interleave.py) and repeated, because this shared 2-core machine is noisy; before each run the
benchmark waits for other processes to go quiet, measures how many cores they
took during the run and repeats a disturbed run (--max-other-load, --retries). The table gives
the median tokens/s with the min-max spread, the ratio to the one-process median, the peak memory
growth per stage and the first batch's loss (identical weights and data in every run, so it must
agree).

Two throughputs per run, from the same measured batches (one segment):
- tokens/s (the headline): from the end of the first measured batch to the end of the last, on the
  last stage, as the training log times its iterations (Megatron's "elapsed time per iteration").
  A training run fills and drains 2BW's pipeline once per segment (between evaluations or
  checkpoints, typically thousands of batches), so this is what training runs at; Flush, GPipe and
  the peers drain every batch, so their drains fall inside the window.
- segment tokens/s: the whole segment's wall time between barriers, 2BW's fill and drain included:
  what a run that evaluated every --measured-batches batches would get.

The layer split is chosen from measured per-layer, embedding and head times unless
--pipeline-layer-split is given, and its ideal speed-up is reported. Right after each
round's 2BW run the two stages also compute side by side without communication, each on its core
(--side-by-side-seconds): how fast the machine let them compute in that round, runtime aside.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import queue as queue_module
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# run from a checkout without installing; `peers` sits next to this file
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from megatron_2bw.config import (Config, ModelConfig, OptimizerConfig, ParallelConfig,  # noqa: E402
                                 TrainingConfig)
from megatron_2bw.data.mock import MockGPTDataset  # noqa: E402
from megatron_2bw.distributed.forked import run_forked  # noqa: E402
from megatron_2bw.distributed.launch import (bind_cores, free_port, pick_device,  # noqa: E402
                                             settle_host_allocator)
from megatron_2bw.distributed.layout import ParallelLayout  # noqa: E402
from megatron_2bw.logging import Timers  # noqa: E402
from megatron_2bw.models import build_stage_model  # noqa: E402
from megatron_2bw.pipeline.partition import layer_ranges  # noqa: E402
from megatron_2bw.tensor_parallel.random import seed_everything  # noqa: E402
from megatron_2bw.training.segments import run_segment  # noqa: E402
from megatron_2bw.training.stage import build_stage  # noqa: E402
from interleave import round_order  # noqa: E402

STAGES = 2
# name -> (processes, what trains it)
RUNS = {
    "one_process": (1, "megatron_2bw, no pipeline"),
    "gpipe": (STAGES, "megatron_2bw GPipe"),
    "flush": (STAGES, "megatron_2bw PipeDream-Flush"),
    "2bw": (STAGES, "megatron_2bw PipeDream-2BW"),
    "pipedream": (STAGES, "megatron_2bw PipeDream (weight stashing)"),
    "zb-h1": (STAGES, "megatron_2bw ZB-H1 (backward split into B and W)"),
    "interleaved": (STAGES, "megatron_2bw interleaved 1F1B, 2 chunks per rank"),
    "torch_1f1b": (STAGES, "torch.distributed.pipelining Schedule1F1B"),
    "torch_gpipe": (STAGES, "torch.distributed.pipelining ScheduleGPipe"),
    "torch_interleaved_1f1b": (STAGES, "torch.distributed.pipelining ScheduleInterleaved1F1B, "
                                       "2 chunks per rank"),
    "torch_zero_bubble": (STAGES, "torch.distributed.pipelining ScheduleInterleavedZeroBubble, "
                                  "1 chunk per rank (ZB-H1)"),
    "deepspeed": (STAGES, "DeepSpeed PipelineEngine (1F1B)"),
    "zb-v": (STAGES, "megatron_2bw ZB-V (two chunks per rank in a V)"),
    "dualpipev": (STAGES, "megatron_2bw DualPipeV (two chunks per rank in a V)"),
    "v-half": (STAGES, "megatron_2bw V-Half (a V at half of 1F1B's activations)"),
    "torch_zbv": (STAGES, "torch.distributed.pipelining ScheduleZBVZeroBubble, 2 chunks per rank "
                          "in a V"),
    "torch_dualpipev": (STAGES, "torch.distributed.pipelining ScheduleDualPipeV, 2 chunks per "
                                "rank in a V"),
}
OURS = ("one_process", "gpipe", "flush", "2bw", "pipedream", "zb-h1", "interleaved", "zb-v",
        "dualpipev", "v-half")
# two model chunks per rank in a V: run when --runs names them (ours beside torch's)
V_RUNS = ("zb-v", "dualpipev", "v-half", "torch_zbv", "torch_dualpipev")
# two model chunks per rank
CHUNKED_RUNS = ("interleaved", "torch_interleaved_1f1b") + V_RUNS
DUALPIPE_RUNS = ("dualpipev", "torch_dualpipev")  # m >= 2 x stages


@dataclass
class Workload:
    """What every run trains: the model, the data and the batch (d = 1: global = micro x m)."""
    model: ModelConfig
    micro_batch: int
    global_batch: int
    warmup_batches: int
    measured_batches: int
    time_shares: bool = False  # our runtime's ranks also time each kind of action (--time-shares)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        optimizer="adam", lr=1e-4, lr_decay_style="constant", clip_grad=1.0))
    seed: int = 1234
    data_seed: int = 7

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def tokens_per_batch(self) -> int:
        return self.global_batch * self.model.seq_length

    def batch_tokens(self, batch: int) -> torch.Tensor:
        """[global batch, seq + 1] token ids of batch `batch` (mock data, the same in every run)."""
        dataset = MockGPTDataset(10 ** 9, self.model.seq_length, self.model.vocab_size, self.data_seed)
        start = batch * self.global_batch
        return torch.stack([torch.from_numpy(dataset[i]["tokens"])
                            for i in range(start, start + self.global_batch)])

    def config(self, stages: int, schedule: str | None, split: list[int] | None) -> Config:
        chunked = schedule in CHUNKED_RUNS  # two chunks per rank, even layers (no split)
        return Config(model=self.model,
                      parallel=ParallelConfig(pipeline_parallel=stages, schedule=schedule,
                                              layer_split=split if stages > 1 and not chunked
                                              else None,
                                              virtual_pipeline_parallel=2
                                              if schedule == "interleaved" else None),
                      optimizer=self.optimizer,
                      training=TrainingConfig(micro_batch_size=self.micro_batch,
                                              global_batch_size=self.global_batch,
                                              train_iters=self.warmup_batches + self.measured_batches,
                                              seed=self.seed))


# -- balancing the stages ------------------------------------------------------------------------

@dataclass(frozen=True)
class StageCosts:
    """Measured seconds of one microbatch's forward + backward, one thread."""
    embedding: float
    layer: float
    head: float  # final norm, logits and loss

    def stage_seconds(self, split: list[int]) -> list[float]:
        return [n * self.layer + (self.embedding if s == 0 else 0.0)
                + (self.head if s == len(split) - 1 else 0.0) for s, n in enumerate(split)]

    def ideal_speedup(self, split: list[int]) -> float:
        """One process's time over the slowest stage's: the best any schedule can do."""
        seconds = self.stage_seconds(split)
        return sum(seconds) / max(seconds)

    def best_split(self, num_layers: int) -> list[int]:
        splits = [[a, num_layers - a] for a in range(1, num_layers)]
        return max(splits, key=self.ideal_speedup)


def measure_stage_costs(workload: Workload, repeats: int = 7) -> StageCosts:
    """Time the embedding, one layer and the head alone: round-robin over the three (so a change in
    the machine's load hits all alike), median of `repeats` after a warm-up pass."""
    config, seed = workload.model, workload.seed
    seed_everything(seed, 0, 0)
    tokens = workload.batch_tokens(0)[:workload.micro_batch]
    hidden = torch.randn(workload.micro_batch, config.seq_length, config.hidden_size)
    parts = {"embedding": (range(0), True, False), "layer": (range(1), False, False),
             "head": (range(0), False, True)}
    models = {name: build_stage_model(config, None, 1, layers, pre, post, seed)
              for name, (layers, pre, post) in parts.items()}
    times: dict[str, list[float]] = {name: [] for name in parts}
    for i in range(repeats + 1):
        for name, (_, pre, post) in parts.items():
            start = time.perf_counter()
            forward_backward(models[name], pre, post, hidden, tokens)
            if i:  # the first pass allocates
                times[name].append(time.perf_counter() - start)
    return StageCosts(**{name: statistics.median(values) for name, values in times.items()})


def forward_backward(model, first: bool, last: bool, hidden: torch.Tensor,
                     tokens: torch.Tensor) -> None:
    """One microbatch through a piece of the model and back, outside any runtime: the first piece
    embeds `tokens`, the others start from `hidden`; the last ends in the loss."""
    out = model(None if first else hidden.clone().requires_grad_(), {"tokens": tokens})
    if last:
        out[0].backward()
    else:
        out.backward(torch.ones_like(out))


# -- the stages computing side by side, without communication -----------------------------------

def _timed_calls(step, seconds: float) -> list[float]:
    """Call `step` for about `seconds`; the duration of each call."""
    durations, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        began = time.perf_counter()
        step()
        durations.append(time.perf_counter() - began)
    return durations


SIDE_BY_SIDE_CYCLES = 3  # together, then each stage alone (alternating which goes first)


def _stage_side_by_side(rank: int, world: int, workload: Workload, split: list[int],
                        seconds: float, bind: bool) -> dict[str, float]:
    """Rank r builds stage r alone and runs its forward+backward, in cycles: while every other
    stage does the same on its core, then alone while the others wait (asleep) in a barrier."""
    if bind:
        bind_cores(rank, world)
    config = workload.model
    first, last = rank == 0, rank == world - 1
    device = pick_device(rank)
    model = build_stage_model(config, None, 1, layer_ranges(config.num_layers, world, split)[rank],
                              first, last, workload.seed).to(device)
    tokens = workload.batch_tokens(0)[:workload.micro_batch].to(device)
    hidden = torch.randn(workload.micro_batch, config.seq_length, config.hidden_size,
                         device=device)

    def step() -> None:
        forward_backward(model, first, last, hidden, tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # the first call allocates
    together: list[float] = []
    alone: list[float] = []
    for cycle in range(SIDE_BY_SIDE_CYCLES):  # this machine's speed drifts within seconds
        dist.barrier()
        together += _timed_calls(step, seconds)
        for turn in (range(world) if cycle % 2 == 0 else reversed(range(world))):
            dist.barrier()
            if turn == rank:
                alone += _timed_calls(step, seconds)
    dist.barrier()
    return {"alone_s": statistics.median(alone), "together_s": statistics.median(together)}


@dataclass(frozen=True)
class SideBySide:
    """One round's forward+backward per microbatch of each stage, alone on its core and with
    every core busy with its own stage: what the machine allows any schedule in that round,
    communication and runtime aside."""
    alone_s: list[float]
    together_s: list[float]

    @property
    def ideal_speedup_alone(self) -> float:
        return sum(self.alone_s) / max(self.alone_s)

    @property
    def ideal_speedup_together(self) -> float:
        """The stages' one-core total over the slowest stage with all cores busy."""
        return sum(self.alone_s) / max(self.together_s)

    def record(self) -> dict:
        return {**dataclasses.asdict(self), "ideal_speedup_alone": self.ideal_speedup_alone,
                "ideal_speedup_together": self.ideal_speedup_together}


def measure_side_by_side(workload: Workload, split: list[int], seconds: float,
                         bind: bool) -> SideBySide:
    # gloo only carries the barriers (on GPUs too): the stages compute on their own devices
    ranks = run_forked(STAGES, _stage_side_by_side, workload, split, seconds, bind,
                       timeout=120.0 + 3 * SIDE_BY_SIDE_CYCLES * STAGES * seconds)
    return SideBySide([r["alone_s"] for r in ranks], [r["together_s"] for r in ranks])


# -- one rank of one run -------------------------------------------------------------------------

class PeakMemory:
    """Peak memory growth of this process from construction: the allocator's peak on CUDA; on CPU
    the kernel's resident-set high-water mark (VmHWM), reset at the start, minus the resident set
    then. The same measure for every run, ours and the peers'."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
            self.base = self._status_bytes("VmRSS")

    @staticmethod
    def _status_bytes(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {key}")

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self._status_bytes("VmHWM") - self.base


class MegatronTrainer:
    """megatron_2bw's runtime: build_stage, then run_segment (a segment of 2BW is one undrained
    1F1B sequence, so the measured batches run as one segment)."""

    def __init__(self, workload: Workload, split, rank: int, world: int, schedule: str | None,
                 device: torch.device):
        self.workload, self.device = workload, device
        config = workload.config(world, schedule, split)
        layout = ParallelLayout(world, 1, world, rank)
        layout.build_groups(config.parallel.timeout_minutes)
        self.first_loss: float | None = None
        # unsynchronised timers: exact on CPU; on CUDA they would time kernel launches
        self.timers = Timers(1) if workload.time_shares else None
        self.stage = build_stage(config, layout, device, self.timers, on_step=self._on_step)
        self._batch: tuple[int, torch.Tensor | None] = (-1, None)
        self.batch_ends: dict[int, float] = {}  # batch -> StepResult.ended_at on this rank

    def _on_step(self, result) -> None:
        # the batch's end (its gradient reduction began); under 2BW the step itself comes later
        self.batch_ends[result.batch] = result.ended_at
        if result.batch == 0 and "lm loss" in result.metrics:
            self.first_loss = result.metrics["lm loss"]

    def _microbatch(self, k: int) -> dict:
        m, micro = self.workload.microbatches, self.workload.micro_batch
        b, j = divmod(k, m)
        if self._batch[0] != b:  # built once per batch, as the peers' data iterators do
            self._batch = (b, self.workload.batch_tokens(b).to(self.device))
        return {"tokens": self._batch[1][j * micro:(j + 1) * micro]}

    def run(self, first_batch: int, batches: int) -> None:
        run_segment(self.stage, first_batch, batches, self._microbatch)


def build_trainer(name: str, workload: Workload, split, rank: int, world: int, device):
    if name in OURS:
        schedule = None if name == "one_process" else name
        return MegatronTrainer(workload, split, rank, world, schedule, device)
    import peers
    if name.startswith("torch_"):
        return peers.TorchPipeliningTrainer(workload, split, rank, world, name[len("torch_"):],
                                            device)
    return peers.DeepSpeedTrainer(workload, split, rank, world, device)


@dataclass
class RankResult:
    seconds: float  # wall time of the measured batches, between barriers
    peak_memory_bytes: int
    first_loss: float | None
    time_shares: dict[str, float] | None = None  # action kind -> share of `seconds` (ours only)
    batch_ends: dict[int, float] = field(default_factory=dict)  # measured batch -> perf_counter


def steady_tokens_per_s(workload: Workload, ranks: list[RankResult]) -> float:
    """Tokens/s from the end of the first measured batch to the end of the last on the last stage
    (the rank that logs the loss), as the training log times iterations: a segment's single fill
    and drain (2BW's) fall outside the window, the per-batch drains of the other schedules inside."""
    ends = ranks[-1].batch_ends
    first = workload.warmup_batches
    last = first + workload.measured_batches - 1
    return (last - first) * workload.tokens_per_batch / (ends[last] - ends[first])


def import_runtime(name: str) -> None:
    """Import what a run's runtime loads lazily before the memory baseline: library code is not
    training memory. (The first torch optimizer imports about 800 modules, ~90 MB and seconds:
    the parent does it once so that forked ranks inherit it.)"""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], foreach=True)
    if name == "deepspeed":
        importlib.import_module("deepspeed")
    elif name.startswith("torch_"):
        importlib.import_module("torch.distributed.pipelining")


def train_one_rank(name: str, workload: Workload, split, rank: int, world: int) -> RankResult:
    device = pick_device(rank)
    import_runtime(name)
    memory = PeakMemory(device)
    trainer = build_trainer(name, workload, split, rank, world, device)
    trainer.run(0, workload.warmup_batches)
    timers = getattr(trainer, "timers", None)
    if timers is not None:
        timers.summary(reset=True)
    _barrier(world)
    start = time.perf_counter()
    trainer.run(workload.warmup_batches, workload.measured_batches)
    _barrier(world)
    seconds = time.perf_counter() - start
    shares = None if timers is None else {name: elapsed / seconds for name, elapsed
                                          in timers.summary(reset=True).items()}
    measured = range(workload.warmup_batches, workload.warmup_batches + workload.measured_batches)
    return RankResult(seconds, memory.peak_bytes(), trainer.first_loss, shares,
                      {b: trainer.batch_ends[b] for b in measured})


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _rank_entry(rank: int, world: int, port: int, results, name, workload, split, timeout, bind):
    if bind:  # every runtime alike, the peers included: rank r on core r
        bind_cores(rank, world)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        if world > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout))
        results.put((rank, train_one_rank(name, workload, split, rank, world), None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the run
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_once(name: str, workload: Workload, split, timeout: float = 900.0,
             bind: bool = True) -> list[RankResult]:
    """One run on freshly forked processes (one per stage); every rank's result, by rank."""
    world = RUNS[name][0]
    context = mp.get_context("fork")  # the children inherit the imports: fast start
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_entry,
                                 args=(rank, world, port, results, name, workload, split, timeout,
                                       bind))
                 for rank in range(world)]
    for process in processes:
        process.start()
    collected: dict[int, RankResult] = {}
    try:
        deadline = time.time() + timeout
        while len(collected) < world:
            try:
                rank, result, error = results.get(timeout=max(1.0, deadline - time.time()))
            except queue_module.Empty:
                raise RuntimeError(f"run {name} did not finish within {timeout:.0f} s") from None
            if error is not None:
                raise RuntimeError(f"run {name}, rank {rank} failed:\n{error}")
            collected[rank] = result
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return [collected[rank] for rank in range(world)]


# -- other processes on the machine --------------------------------------------------------------

def machine_cpu_seconds() -> float:
    """CPU seconds every process on the machine has used (Linux /proc/stat, all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its finished (joined) children: the runs' ranks."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """Cores that other processes kept busy between start() and stop(): a shared machine is
    noisy, so each run says how disturbed it was."""

    def start(self) -> None:
        self.wall, self.machine, self.own = time.time(), machine_cpu_seconds(), own_cpu_seconds()

    def stop(self) -> float:
        others = (machine_cpu_seconds() - self.machine) - (own_cpu_seconds() - self.own)
        return max(0.0, others) / max(time.time() - self.wall, 1e-6)


def wait_for_idle(max_cores: float, timeout: float, window: float = 2.0) -> float:
    """Wait (up to `timeout` s) until other processes use at most `max_cores` over a `window`;
    return the last window's value."""
    deadline = time.time() + timeout
    meter = OtherLoad()
    while True:
        meter.start()
        time.sleep(window)
        load = meter.stop()
        if load <= max_cores or time.time() >= deadline:
            return load


# -- the benchmark -------------------------------------------------------------------------------

@dataclass
class RunSummary:
    name: str
    tokens_per_s: list[float] = field(default_factory=list)  # one per repeat (steady_tokens_per_s)
    segment_tokens_per_s: list[float] = field(default_factory=list)  # one per repeat (wall)
    other_load: list[float] = field(default_factory=list)  # cores other processes used, per repeat
    peak_memory_bytes: list[int] = field(default_factory=list)  # per stage, max over repeats
    first_loss: float | None = None
    time_shares: list[list[dict[str, float]]] = field(default_factory=list)  # repeat, stage

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def segment_median(self) -> float:
        return statistics.median(self.segment_tokens_per_s)

    def median_time_shares(self) -> list[dict[str, float]]:
        """Per stage: each action kind's median share of the measured time over the repeats."""
        if not self.time_shares:
            return []
        return [{name: statistics.median(repeat[stage].get(name, 0.0)
                                         for repeat in self.time_shares)
                 for name in self.time_shares[0][stage]}
                for stage in range(len(self.time_shares[0]))]


@dataclass
class Quietness:
    """How hard to try for an undisturbed machine: before each run wait until other processes use
    at most `max_other_cores`; repeat a run that they disturbed more than that, `retries` times."""
    max_other_cores: float = 0.25
    idle_timeout: float = 300.0
    retries: int = 2


def _undisturbed(measure, quiet: Quietness, meter: OtherLoad):
    """measure() on a quiet machine: wait for other processes to go quiet, and measure again
    (up to quiet.retries times) if they disturbed it; the result and the cores they took."""
    for _ in range(quiet.retries + 1):
        if quiet.idle_timeout > 0:
            wait_for_idle(quiet.max_other_cores, quiet.idle_timeout)
        meter.start()
        result = measure()
        load = meter.stop()
        if load <= quiet.max_other_cores:
            break
    return result, load


def benchmark(workload: Workload, names: list[str], split: list[int], repeats: int,
              quiet: Quietness | None = None, progress=None, bind: bool = True,
              side_by_side_seconds: float = 0.0
              ) -> tuple[list[RunSummary], list[SideBySide], list[list[str]]]:
    """Interleaved: every configuration once per round, `repeats` rounds, each round in its own
    order (returned). In each round, right after the 2BW run (the round's last run without one),
    the stages compute side by side for `side_by_side_seconds` per phase (0: not measured)."""
    quiet = quiet or Quietness(max_other_cores=float("inf"), idle_timeout=0.0, retries=0)
    summaries = {name: RunSummary(name, peak_memory_bytes=[0] * RUNS[name][0]) for name in names}
    side_by_side: list[SideBySide] = []
    orders: list[list[str]] = []
    import_runtime("one_process")
    meter = OtherLoad()
    for round_index in range(repeats):
        orders.append([names[i] for i in round_order(len(names), round_index)])
        side_by_side_after = "2bw" if "2bw" in names else orders[-1][-1]  # beside what it explains
        for name in orders[-1]:
            ranks, load = _undisturbed(functools.partial(run_once, name, workload, split,
                                                         bind=bind), quiet, meter)
            seconds = max(r.seconds for r in ranks)
            summary = summaries[name]
            summary.tokens_per_s.append(steady_tokens_per_s(workload, ranks))
            summary.segment_tokens_per_s.append(workload.measured_batches
                                                * workload.tokens_per_batch / seconds)
            summary.other_load.append(load)
            summary.peak_memory_bytes = [max(a, r.peak_memory_bytes)
                                         for a, r in zip(summary.peak_memory_bytes, ranks)]
            summary.first_loss = next((r.first_loss for r in ranks if r.first_loss is not None),
                                      None)
            if all(r.time_shares is not None for r in ranks):
                summary.time_shares.append([r.time_shares for r in ranks])
            if progress is not None:
                progress.set_postfix_str(f"{name}: {summary.tokens_per_s[-1]:.0f} tokens/s, "
                                         f"others {load:.2f} cores")
                progress.update(1)
            if side_by_side_seconds > 0 and name == side_by_side_after:
                stages, _ = _undisturbed(functools.partial(measure_side_by_side, workload, split,
                                                           side_by_side_seconds, bind), quiet,
                                         meter)
                side_by_side.append(stages)
    return list(summaries.values()), side_by_side, orders


def format_side_by_side(rounds: list[SideBySide], summaries: list[RunSummary]) -> str:
    """Per round: how much each stage slowed with both cores busy, the ideal speed-up that left,
    and what our 2BW reached in the same round."""
    runs = {s.name: s.tokens_per_s for s in summaries}
    lines = ["stages side by side (each on its core, forward+backward, no communication), "
             "per round:"]
    for i, r in enumerate(rounds):
        slowdowns = ", ".join(f"stage {s} {a * 1e3:.0f} -> {t * 1e3:.0f} ms ({t / a - 1:+.1%})"
                              for s, (a, t) in enumerate(zip(r.alone_s, r.together_s)))
        line = (f"  round {i + 1}: {slowdowns}; ideal {r.ideal_speedup_alone:.2f}x alone, "
                f"{r.ideal_speedup_together:.2f}x with both cores busy")
        if "2bw" in runs and "one_process" in runs:
            line += f"; 2bw measured {runs['2bw'][i] / runs['one_process'][i]:.2f}x"
        lines.append(line)
    return "\n".join(lines)


def format_table(summaries: list[RunSummary], baseline: float | None,
                 segment_baseline: float | None) -> str:
    lines = [f"{'run':<12} {'tokens/s (median)':>17} {'min-max':>11} {'x one proc':>10} "
             f"{'segment tokens/s':>16} {'x one proc':>10} {'peak MiB per stage':>18} "
             f"{'batch-0 loss':>12} {'others':>6}  trained by", "-" * 154]
    for s in summaries:
        spread = f"{min(s.tokens_per_s):.0f}-{max(s.tokens_per_s):.0f}"
        ratio = f"{s.median / baseline:.2f}x" if baseline else "-"
        segment_ratio = f"{s.segment_median / segment_baseline:.2f}x" if segment_baseline else "-"
        memory = " | ".join(f"{b / 2 ** 20:.0f}" for b in s.peak_memory_bytes)
        loss = f"{s.first_loss:.4f}" if s.first_loss is not None else "-"
        lines.append(f"{s.name:<12} {s.median:>17.0f} {spread:>11} {ratio:>10} "
                     f"{s.segment_median:>16.0f} {segment_ratio:>10} {memory:>18} "
                     f"{loss:>12} {max(s.other_load):>6.2f}  {RUNS[s.name][1]}")
    lines += ["tokens/s: from the end of the first measured batch to the end of the last, on the "
              "last stage (as the training log times iterations; 2BW's one fill and drain per "
              "segment outside, every other schedule's per-batch drains inside)",
              "segment tokens/s: the whole segment between barriers (2BW's fill and drain inside)",
              "others: the most cores other processes kept busy during any repeat of the run"]
    return "\n".join(lines)


def measured_bubbles(summary: RunSummary) -> list[float]:
    """Per stage: the share of the measured time it did not compute (forward, backward, B, W)."""
    return [1.0 - shares.get("forward", 0.0) - shares.get("backward", 0.0)
            for shares in summary.median_time_shares()]


def format_time_shares(summaries: list[RunSummary]) -> str:
    """Where each stage of our runs spent the measured time (median share over the repeats), and
    the measured bubble (the time a stage did not compute)."""
    lines = ["time per stage by action (median share of the measured time over the repeats):"]
    for s in summaries:
        for stage, shares in enumerate(s.median_time_shares()):
            parts = ", ".join(f"{name} {share:.1%}" for name, share in
                              sorted(shares.items(), key=lambda item: -item[1]))
            rest = 1.0 - sum(shares.values())
            lines.append(f"  {s.name:<11} stage {stage}: {parts}, other {rest:.1%}; not "
                         f"computing {measured_bubbles(s)[stage]:.1%}")
    return "\n".join(lines)


def plot(summaries: list[RunSummary], baseline: float | None, output: str, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
    from matplotlib.patches import Patch
    fig = Figure(figsize=(11, 4.6))
    speed_ax, memory_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    names = [s.name for s in summaries]
    medians = [s.median for s in summaries]
    errors = [[m - min(s.tokens_per_s) for m, s in zip(medians, summaries)],
              [max(s.tokens_per_s) - m for m, s in zip(medians, summaries)]]
    ours = OURS
    colours = ["#7f7f7f" if n == "one_process" else "#2ca02c" if n in ours else "#9467bd"
               for n in names]
    bars = speed_ax.bar(names, medians, yerr=errors, capsize=4, color=colours)
    speed_ax.legend(handles=[Patch(color="#2ca02c", label="megatron_2bw, 2 processes"),
                             Patch(color="#9467bd", label="peers, 2 processes")],
                    fontsize=8, loc="upper right")
    if baseline:
        speed_ax.bar_label(bars, [f"{m / baseline:.2f}x" for m in medians], padding=2, fontsize=8)
        speed_ax.axhline(baseline, color="#7f7f7f", linestyle=":", linewidth=1)
    speed_ax.set_ylabel("tokens/s (median, whiskers: min-max)")
    speed_ax.set_title("throughput (label: ratio to one process)", fontsize=10)
    speed_ax.tick_params(axis="x", rotation=30)
    width = 0.38
    for stage in range(STAGES):
        # one bar per stage side by side; the one-process run's single bar is centred
        runs = [(i, s) for i, s in enumerate(summaries) if stage < len(s.peak_memory_bytes)]
        memory_ax.bar([i + ((stage - 0.5) * width if len(s.peak_memory_bytes) > 1 else 0.0)
                       for i, s in runs], [s.peak_memory_bytes[stage] / 2 ** 20 for _, s in runs],
                      width, label=f"stage {stage}" if stage else "stage 0 (or the whole model)")
    memory_ax.set_xticks(range(len(names)), names, rotation=30)
    memory_ax.set_ylabel("peak resident memory growth (MiB)")
    memory_ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.06), ncol=2,
                     frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeline_throughput.py",
                                     description=__doc__.split("\n")[0])
    g = parser.add_argument_group("model, data and batch (the same in every run)")
    g.add_argument("--num-layers", type=int, default=9)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--vocab-size", type=int, default=8192)
    g.add_argument("--micro-batch-size", type=int, default=8,
                   help="default 8: twice micro batch 4's compute for the same weight and "
                        "gradient traffic per microbatch, so two busy cores contend less")
    g.add_argument("--global-batch-size", type=int, default=16,
                   help="micro batch x m (one data-parallel replica); default m = 2")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="an output layer of its own (pipedream needs it)")
    g.add_argument("--pipeline-layer-split", type=str,
                   help="layers per stage, e.g. 5,3 (default: the best split for measured times)")
    b = parser.add_argument_group("measurement")
    b.add_argument("--warmup-batches", type=int, default=2)
    b.add_argument("--measured-batches", type=int, default=24,
                   help="batches timed per run, as one segment (2BW fills and drains once); at "
                        "least 2 (tokens/s runs from the first's end to the last's)")
    b.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median, min-max)")
    b.add_argument("--runs", help=f"comma-separated subset of {','.join(RUNS)} (default: every "
                                  f"run the model takes: the two-chunk runs need layers and m "
                                  f"to split into 2 x {STAGES} chunks and groups of {STAGES})")
    b.add_argument("--no-bind-cores", action="store_true",
                   help="leave ranks unbound (default: rank r of every run, peers included, on "
                        "core r, as --bind-cores-to-rank does in training)")
    b.add_argument("--max-other-load", type=float, default=0.25, metavar="CORES",
                   help="before each run wait until other processes use at most this many cores, "
                        "and repeat a run they disturbed more (default 0.25)")
    b.add_argument("--idle-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="longest wait for an idle machine before a run (0: do not wait)")
    b.add_argument("--retries", type=int, default=2,
                   help="extra attempts of a run disturbed by other processes (default 2)")
    b.add_argument("--time-shares", action="store_true",
                   help="also time forward, backward, p2p waits, gradient reduction and optimizer "
                        "on our runtime's ranks and print each stage's shares (CPU: unsynchronised "
                        "timers)")
    b.add_argument("--side-by-side-seconds", type=float, default=2.0, metavar="SECONDS",
                   help="each round also runs the stages without communication, each on its core, "
                        f"in {SIDE_BY_SIDE_CYCLES} cycles of phases this long: all together, then "
                        "each alone; how fast the machine let the stages compute in that round "
                        "(0: skip)")
    b.add_argument("--json", help="write the results as JSON to this file")
    b.add_argument("--plot", help="write a PNG bar chart to this file")
    return parser


def fail(message: str) -> None:
    print(f"pipeline_throughput.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_workload(args) -> tuple[Workload, list[str], list[int] | None]:
    if min(args.max_other_load, args.idle_timeout, args.retries, args.side_by_side_seconds) < 0:
        fail("--max-other-load, --idle-timeout, --retries and --side-by-side-seconds must not be "
             "negative")
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                 "micro_batch_size", "global_batch_size", "measured_batches", "repeats"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if args.measured_batches < 2:
        fail(f"--measured-batches must be >= 2 (tokens/s runs from the end of the first measured "
             f"batch to the end of the last), got {args.measured_batches}")
    if args.warmup_batches < 1:
        fail(f"--warmup-batches must be >= 1 (batch 0's loss is compared), got {args.warmup_batches}")
    if args.global_batch_size % args.micro_batch_size:
        fail(f"--global-batch-size {args.global_batch_size} must be a multiple of "
             f"--micro-batch-size {args.micro_batch_size}")
    m = args.global_batch_size // args.micro_batch_size
    if m < STAGES:
        fail(f"--global-batch-size / --micro-batch-size = {m} microbatches, but the 1F1B schedules "
             f"need at least {STAGES} (the number of stages)")
    if args.hidden_size % args.num_attention_heads:
        fail(f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
             f"{args.num_attention_heads}")
    if args.num_layers < STAGES:
        fail(f"--num-layers {args.num_layers} must be at least {STAGES} (one per stage)")
    chunks_fit = args.num_layers % (2 * STAGES) == 0 and m % STAGES == 0
    if args.runs is None:  # the runs this model allows: chunks where layers split, untied pipedream
        args.runs = ",".join(n for n in RUNS if (chunks_fit or n not in CHUNKED_RUNS) and
                             n not in V_RUNS and
                             (args.untie_embeddings_and_output_weights or n != "pipedream"))
    chunked = [n for n in args.runs.split(",") if n.strip() in CHUNKED_RUNS]
    if chunked and not chunks_fit:
        fail(f"--runs {','.join(chunked)}: two chunks per rank need --num-layers a multiple of "
             f"{2 * STAGES} (got {args.num_layers}) and m a multiple of {STAGES} (got {m})")
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    dualpipe = [n for n in names if n in DUALPIPE_RUNS]
    if dualpipe and m < 2 * STAGES:
        fail(f"--runs {','.join(dualpipe)}: DualPipeV needs at least {2 * STAGES} microbatches "
             f"(2 x stages), got --global-batch-size / --micro-batch-size = {m}")
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        fail(f"--runs expects a comma-separated subset of {','.join(RUNS)}, got {args.runs!r}")
    if "pipedream" in names and not args.untie_embeddings_and_output_weights:
        fail("--runs pipedream needs --untie-embeddings-and-output-weights (its stages would read "
             "two versions of the tied word embeddings)")
    split = None
    if args.pipeline_layer_split:
        try:
            split = [int(x) for x in args.pipeline_layer_split.split(",")]
            layer_ranges(args.num_layers, STAGES, split)
        except ValueError:
            fail(f"--pipeline-layer-split expects {STAGES} positive comma-separated layer counts "
                 f"summing to --num-layers {args.num_layers}, got {args.pipeline_layer_split!r}")
    for flag in ("json", "plot"):
        path = getattr(args, flag)
        if path and not Path(path).resolve().parent.is_dir():
            fail(f"--{flag} {path}: directory {Path(path).parent} does not exist")
    model = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                        vocab_size=args.vocab_size, hidden_dropout=0.0, attention_dropout=0.0,
                        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights)
    workload = Workload(model, args.micro_batch_size, args.global_batch_size, args.warmup_batches,
                        args.measured_batches, time_shares=args.time_shares)
    return workload, names, split


def main(argv=None) -> list[RunSummary]:
    from tqdm import tqdm
    args = build_parser().parse_args(argv)
    workload, names, split = parse_workload(args)
    torch.set_num_threads(1)  # the one-process baseline, and the cost profile, use one thread too
    settle_host_allocator()  # as a launched rank; every run's forked ranks inherit it
    costs = measure_stage_costs(workload)
    split = split or costs.best_split(workload.model.num_layers)
    model = workload.model
    print(f"model: GPT, {model.num_layers} layers, hidden {model.hidden_size}, "
          f"{model.num_attention_heads} heads, sequence {model.seq_length}, vocabulary "
          f"{model.padded_vocab_size(1)}, fp32; batch {workload.global_batch} = "
          f"{workload.microbatches} microbatches of {workload.micro_batch}; "
          f"{workload.warmup_batches} warm-up + {workload.measured_batches} measured batches per run; "
          f"1 thread per process{'' if args.no_bind_cores else ', rank r bound to core r'}")
    print(f"measured forward+backward per microbatch: embedding {costs.embedding * 1e3:.1f} ms, "
          f"layer {costs.layer * 1e3:.1f} ms, head (norm, logits, loss) {costs.head * 1e3:.1f} ms")
    stage_ms = ", ".join(f"{s * 1e3:.0f}" for s in costs.stage_seconds(split))
    print(f"layer split {split}: stage times {stage_ms} ms per microbatch, ideal speed-up "
          f"{costs.ideal_speedup(split):.2f}x (total / slowest stage)")
    quiet = Quietness(args.max_other_load, args.idle_timeout, args.retries)
    with tqdm(total=len(names) * args.repeats, desc="runs", unit="run", file=sys.stderr) as bar:
        summaries, side_by_side, orders = benchmark(workload, names, split, args.repeats, quiet,
                                                    bar, bind=not args.no_bind_cores,
                                                    side_by_side_seconds=args.side_by_side_seconds)
    baseline = next((s.median for s in summaries if s.name == "one_process"), None)
    segment_baseline = next((s.segment_median for s in summaries if s.name == "one_process"), None)
    print(format_table(summaries, baseline, segment_baseline))
    if workload.time_shares:
        print(format_time_shares(summaries))
    if side_by_side:
        print(format_side_by_side(side_by_side, summaries))
    if args.json:
        record = {"model": {k: getattr(model, k) for k in ("num_layers", "hidden_size",
                                                           "num_attention_heads", "seq_length",
                                                           "vocab_size")},
                  "micro_batch_size": workload.micro_batch,
                  "global_batch_size": workload.global_batch,
                  "layer_split": split, "ideal_speedup": costs.ideal_speedup(split),
                  "stage_costs_s": dataclasses.asdict(costs),
                  "stages_side_by_side": [r.record() for r in side_by_side],
                  "orders": orders,  # per round, the runs in the order they ran
                  "throughput": "tokens_per_s: from the end of the first measured batch to the "
                                "end of the last on the last stage; segment_tokens_per_s: the "
                                "measured segment's wall time between barriers",
                  "runs": [{"name": s.name, "tokens_per_s": s.median,
                            "tokens_per_s_repeats": s.tokens_per_s,
                            "segment_tokens_per_s": s.segment_median,
                            "segment_tokens_per_s_repeats": s.segment_tokens_per_s,
                            "other_processes_cores": s.other_load,
                            "speedup_vs_one_process": s.median / baseline if baseline else None,
                            "segment_speedup_vs_one_process":
                                s.segment_median / segment_baseline if segment_baseline else None,
                            "peak_memory_bytes": s.peak_memory_bytes,
                            "first_batch_loss": s.first_loss,
                            **({"time_shares_per_stage": s.median_time_shares(),
                                "not_computing_per_stage": measured_bubbles(s),
                                "time_shares_per_repeat": s.time_shares}
                               if s.time_shares else {})} for s in summaries]}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    if args.plot:
        plot(summaries, baseline, args.plot,
             f"GPT {model.num_layers}L h{model.hidden_size} s{model.seq_length} "
             f"V{model.padded_vocab_size(1)}, batch {workload.global_batch} (m = "
             f"{workload.microbatches}), split {split}, ideal {costs.ideal_speedup(split):.2f}x; "
             f"2 processes x 1 thread vs 1 process x 1 thread")
    return summaries


if __name__ == "__main__":
    main()
