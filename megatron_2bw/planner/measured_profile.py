"""The measured profile (`MeasuredProfile`), on the device at hand: runs the real model code
(megatron_2bw.models) for one layer, the embedding and the head for the requested tensor-parallel
sizes and micro batch sizes, counts the bytes a layer stashes with saved-tensor hooks, and caches
the numbers as JSON per (hardware name, model shape (with a head size other than hidden / heads)
and architecture switches, --sequence-parallel when a t > 1 is measured, the fp32 softmax when the
dtype is fp16/bf16, dtype); under --sequence-parallel a t > 1 layer and head are fed [b, s/t, h],
as in training. A tensor-parallel size t is timed in this one process on one rank's shard
(`ShardShapeGroup`: the shard's shapes, no collectives; cost.py adds those), so the narrower
kernels' lower efficiency is measured, not assumed. Micro batch sizes not measured are interpolated
linearly in b; a t not measured scales the t = 1 figures by the analytic ratio. Where a job's CPU
ranks outnumber a node's cores it also measures what taking turns on a core costs a layer
(`measure_turn_taking`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from megatron_2bw.config import ModelConfig, PrecisionConfig
from megatron_2bw.distributed.comm import ShardShapeGroup
from megatron_2bw.distributed.launch import settle_host_allocator, usable_cores
from megatron_2bw.planner.analytic_profile import AnalyticProfile
from megatron_2bw.planner.hardware import HardwareSpec, timed_call
from megatron_2bw.planner.memory import dtype_bytes, unfused_attention
from megatron_2bw.planner.profile import ComputeCosts


def _synthetic_batch(model: ModelConfig, b: int, device) -> dict:
    s, v = model.seq_length, max(model.vocab_size, 2)
    if model.model_type == "bert":
        text = torch.randint(0, v, (b, s), device=device)
        return {"text": text, "types": torch.zeros_like(text), "labels": text,
                "padding_mask": torch.ones_like(text), "loss_mask": torch.ones_like(text),
                "is_random": torch.zeros(b, dtype=torch.long, device=device)}
    return {"tokens": torch.randint(0, v, (b, s + 1), device=device)}


def _piece(model: ModelConfig, tensor_parallel: int, layers: int, pre: bool, post: bool, dtype,
           device):
    """One rank's shard of the real stage module holding only the piece to time, randomly
    initialised."""
    from megatron_2bw.models import MODELS
    group = ShardShapeGroup(tensor_parallel) if tensor_parallel > 1 else None
    module = MODELS[model.model_type](model, group, model.padded_vocab_size(tensor_parallel),
                                      range(layers), pre, post)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, model.init_method_std)
    return module.to(device=device, dtype=dtype).train()


def saved_activation_bytes(layer, hidden: torch.Tensor, mask=None,
                           rotary=None) -> tuple[float, float]:
    """(without, with selective recomputation) bytes a TransformerLayer stashes for its backward:
    unique storages seen by saved_tensors_hooks, parameters excluded. The attention core's own
    saves are told apart by wrapping it, and selective keeps the core's inputs instead (held here
    until the count is done: a core input nothing saves is freed, and a later storage at its
    address would count once for two). `rotary`: the stack's (cos, sin) for rotary embeddings."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    outside: dict[int, int] = {}
    inside: dict[int, int] = {}
    core_inputs: dict[int, int] = {}
    held = []
    in_core = [False]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            (inside if in_core[0] else outside)[storage.data_ptr()] = storage.nbytes()
        return tensor

    original_core = layer.attention.core

    def core(q, k, v, core_mask):
        held.append((q, k, v))
        for x in (q, k, v):
            core_inputs[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        in_core[0] = True
        try:
            return original_core(q, k, v, core_mask)
        finally:
            in_core[0] = False

    layer.attention.core = core
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(hidden, mask, rotary)
    finally:
        del layer.attention.core  # back to the class's method
    return float(sum({**outside, **inside}.values())), float(sum({**outside, **core_inputs}.values()))


def _modules_by_t(model: ModelConfig, sizes: list[tuple[int, int]], dtype, device) -> dict:
    """Per tensor-parallel size of `sizes`: one rank's shard of a layer, the embedding and the
    head (what _size_pieces times)."""
    return {t: {"body": _piece(model, t, 1, False, False, dtype, device),
                "embedding": _piece(model, t, 0, True, False, dtype, device),
                "head": _piece(model, t, 0, False, True, dtype, device)}
            for t in sorted({t for t, _ in sizes})}


def _forward_backward(run_forward) -> tuple[tuple, tuple]:
    """(fn, setup) of the forward, and of the backward of a fresh untimed forward; run_forward()
    returns (output, gradient for it)."""
    pending = []

    def backward():
        output, grad = pending.pop()
        torch.autograd.backward(output, grad)

    return (run_forward, None), (backward, lambda: pending.append(run_forward()))


def _size_pieces(model: ModelConfig, modules: dict, b: int, device
                 ) -> tuple[dict[str, tuple], dict[str, float]]:
    """What measure_costs times for one (t, b), by record name, as (fn, setup), and the layer's
    stashed bytes. `modules` holds t's layer, embedding and head (the same for every b). Under
    --sequence-parallel (t > 1) the layer and the head are fed, and the embedding returns, this
    rank's s/t tokens, as in training (the layer and the head gather the sequence themselves)."""
    s, h = model.seq_length, model.hidden_size
    body, embedding, head = modules["body"], modules["embedding"], modules["head"]
    dtype = next(body.parameters()).dtype
    batch = _synthetic_batch(model, b, device)
    local = s // body.transformer.sequence_ranks
    hidden = torch.randn(b, local, h, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(b, local, h, device=device, dtype=dtype)
    layer = next(iter(body.transformer.layers.values()))
    mask = None
    if model.model_type == "bert":
        from megatron_2bw.models.bert import padding_attention_mask
        mask = padding_attention_mask(batch["padding_mask"])
    rotary = None if body.transformer.rotary is None else body.transformer.rotary(s, device=device)
    full_bytes, selective_bytes = saved_activation_bytes(layer, hidden, mask, rotary)
    with torch.no_grad():
        q, k, v = layer.attention.project_qkv(hidden, rotary)
    layer_f, layer_b = _forward_backward(lambda: (body(hidden, batch), grad))
    emb_f, emb_b = _forward_backward(lambda: (embedding(None, batch), grad))
    head_f, head_b = _forward_backward(lambda: (head(hidden, batch)[0], None))
    timed = {"layer_forward_s": layer_f, "layer_backward_s": layer_b,
             "attention_core_forward_s": (lambda: layer.attention.core(q, k, v, mask), None),
             "embedding_forward_s": emb_f, "embedding_backward_s": emb_b,
             "head_forward_s": head_f, "head_backward_s": head_b}
    return timed, {"layer_activation_bytes": full_bytes,
                   "selective_layer_activation_bytes": selective_bytes}


def measure_costs(model: ModelConfig, precision: PrecisionConfig, sizes: list[tuple[int, int]],
                  device: torch.device | None = None, repeats: int = 7
                  ) -> dict[tuple[int, int], dict]:
    """Per (t, b) of `sizes`: one rank's shard of a layer, the embedding and the head timed, and
    the layer's stashed bytes (JSON-able records). Each figure is the median of `repeats` runs
    (on a shared machine fewer let one slow run decide: 3 gave a micro batch of 2 a slower layer
    than one of 4 under a load average of 4), after one warm-up run. The sizes are interleaved
    run by run: each piece runs once at every size before its next run at any, so the machine's
    drift from second to second moves every size alike and the ratios between sizes, which
    decide the planner's choice of micro batch, stay steady. (Size by size, a layer's time at
    b = 4 over b = 2 had a standard deviation of 0.37 between passes here; interleaved, 0.05.)"""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, precision.working_dtype_name)
    modules = _modules_by_t(model, sizes, dtype, device)
    pieces = {(t, b): _size_pieces(model, modules[t], b, device) for t, b in sizes}
    names = list(next(iter(pieces.values()))[0])
    samples = {key: {name: [] for name in names} for key in pieces}
    for run in range(repeats + 1):  # run 0 warms up
        for name in names:
            for key, (timed, _) in pieces.items():
                fn, setup = timed[name]
                seconds = timed_call(fn, device, setup)
                if run:
                    samples[key][name].append(seconds)
    return {key: {**{name: statistics.median(runs) for name, runs in samples[key].items()},
                  **stashed}
            for key, (_, stashed) in pieces.items()}


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_2BW_PLANNER_CACHE",
                               Path.home() / ".cache" / "megatron_2bw" / "planner"))


def _profile_identity(model: ModelConfig) -> dict:
    """Everything of the model that changes a piece's time or bytes (dropout doubles a CPU layer's
    forward here): a cached profile serves only a model with the same identity."""
    m = model
    identity = {"type": m.model_type, "hidden_size": m.hidden_size,
                "num_attention_heads": m.num_attention_heads, "ffn_hidden_size": m.ffn_hidden_size,
                "seq_length": m.seq_length, "max_position_embeddings": m.max_position_embeddings,
                "padded_vocab_size": m.padded_vocab_size(1), "hidden_dropout": m.hidden_dropout,
                "attention_dropout": m.attention_dropout}
    if m.model_type == "bert":
        identity.update(bert_binary_head=m.bert_binary_head, num_tokentypes=m.num_tokentypes)
    if m.sequence_parallel:  # what a t > 1 shard is fed (measured_profile drops it for t = 1 only)
        identity.update(sequence_parallel=True)
    return identity | _architecture(m)


# short names of the architecture switches in a cache file's name
_SWITCH_NAMES = {"normalization": "", "bias_linear": "bias", "qkv_bias": "qkvbias",
                 "swiglu": "swiglu", "openai_gelu": "tanhgelu", "position_embedding_type": "pos",
                 "rotary_percent": "rot",
                 "rotary_interleaved": "interleaved", "query_groups": "g", "head_dim": "kv",
                 "qk_layernorm": "qknorm", "layernorm_1p": "norm1p",
                 "softmax_in_fp32": "fp32softmax"}


def _architecture(model: ModelConfig) -> dict:
    """The Llama-style switches (config.ModelConfig) set away from GPT-2's layout, each of which
    changes a layer's time or bytes (among them a head size other than hidden / heads,
    --kv-channels, which the hidden size and heads of the file name do not tell), and the fp32
    softmax (numerics, which measured_profile drops in fp32, where it changes nothing; layer
    scaling implies it and times the same); a GPT-2 model's identity and file name stay as they
    were before the switches existed. Untying the output layer changes neither (same shapes)."""
    m = model
    rope = m.position_embedding_type == "rope"
    switches = {"normalization": m.normalization, "bias_linear": m.add_bias_linear,
                "qkv_bias": m.add_bias_linear or m.add_qkv_bias, "swiglu": m.swiglu,
                "openai_gelu": m.openai_gelu, "position_embedding_type": m.position_embedding_type,
                "rotary_percent": m.rotary_percent if rope else 1.0,
                "rotary_interleaved": rope and m.rotary_interleaved,
                "query_groups": m.query_groups, "head_dim": m.head_dim,
                "qk_layernorm": m.qk_layernorm, "layernorm_1p": m.apply_layernorm_1p,
                "softmax_in_fp32": m.softmax_in_fp32}
    gpt2 = {"normalization": "LayerNorm", "bias_linear": True, "qkv_bias": True, "swiglu": False,
            "openai_gelu": False, "position_embedding_type": "learned_absolute", "rotary_percent": 1.0,
            "rotary_interleaved": False, "query_groups": m.num_attention_heads,
            "head_dim": m.hidden_size // m.num_attention_heads, "qk_layernorm": False,
            "layernorm_1p": False, "softmax_in_fp32": False}
    return {key: value for key, value in switches.items() if value != gpt2[key]}


def architecture_name(model: ModelConfig) -> str:
    """e.g. "-RMSNorm-nobias-swiglu-posrope-g2-kv128-qknorm" ("" for GPT-2's layout)."""
    parts = []
    for key, value in _architecture(model).items():
        if isinstance(value, bool):
            parts.append(("" if value else "no") + _SWITCH_NAMES[key])
        else:
            parts.append(f"{_SWITCH_NAMES[key]}{value:g}" if isinstance(value, float)
                         else f"{_SWITCH_NAMES[key]}{value}")
    return "".join(f"-{part}" for part in parts)


def _cache_path(cache_dir: Path, hardware_name: str, model: ModelConfig,
                precision: PrecisionConfig, processes: int = 1) -> Path:
    m = model
    name = (f"{m.model_type}-h{m.hidden_size}-a{m.num_attention_heads}-f{m.ffn_hidden_size}"
            f"-s{m.seq_length}-v{m.padded_vocab_size(1)}")
    if m.max_position_embeddings != m.seq_length:
        name += f"-pos{m.max_position_embeddings}"
    name += architecture_name(m)
    if m.sequence_parallel:
        name += "-sp"
    name += f"-dropout{m.hidden_dropout:g}-{m.attention_dropout:g}"
    if m.model_type == "bert":
        name += f"-types{m.num_tokentypes}" + ("-binary" if m.bert_binary_head else "")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in hardware_name)
    at_once = f"__x{processes}" if processes > 1 else ""
    return Path(cache_dir) / f"{safe}__{name}__{precision.working_dtype_name}{at_once}.json"


class MeasuredProfile:
    """Measured costs per (t, micro batch size); other sizes interpolated, other t scaled."""

    def __init__(self, records: dict[tuple[int, int], dict], analytic: AnalyticProfile):
        if not any(t == 1 for t, _ in records):
            raise ValueError("a measured profile needs at least one micro batch size at t = 1")
        self.records: dict[int, dict[int, dict]] = {}
        for (t, b), record in records.items():
            self.records.setdefault(int(t), {})[int(b)] = record
        self.analytic = analytic

    @staticmethod
    def _interpolate(records: dict[int, dict], key: str, b: int) -> float:
        if b in records:
            return records[b][key]
        sizes = sorted(records)
        if len(sizes) == 1:
            return records[sizes[0]][key] * b / sizes[0]
        # least-squares line through the measurements: fixed cost + cost per sample
        mean_b = sum(sizes) / len(sizes)
        values = [records[x][key] for x in sizes]
        mean_v = sum(values) / len(values)
        slope = sum((x - mean_b) * (v - mean_v) for x, v in zip(sizes, values)) / \
            sum((x - mean_b) ** 2 for x in sizes)
        return max(mean_v + slope * (b - mean_b), 0.0)

    def costs(self, tensor_parallel: int, micro_batch_size: int) -> ComputeCosts:
        b, t = micro_batch_size, tensor_parallel
        records = self.records[t if t in self.records else 1]
        # a figure with a default that some record lacks (not measured there) takes the default
        keys = [f.name for f in dataclasses.fields(ComputeCosts)
                if f.default is dataclasses.MISSING or all(f.name in r for r in records.values())]
        if t in self.records:
            return ComputeCosts(**{k: self._interpolate(records, k, b) for k in keys})
        measured = {k: self._interpolate(records, k, b) for k in keys}
        full = dataclasses.asdict(self.analytic.costs(1, b))
        shard = dataclasses.asdict(self.analytic.costs(t, b))
        return ComputeCosts(**{k: v * shard[k] / full[k] if full[k] else v
                               for k, v in measured.items()})


PROFILE_ROUNDS = 5


def median_record(records: list[dict]) -> dict:
    """Each figure of several measure_costs records of one size: the median."""
    return {name: statistics.median(record[name] for record in records) for name in records[0]}


def profiling_processes(hardware: HardwareSpec, world_size: int) -> int:
    """How many of a node's ranks compute at once in a `world_size`-rank job: its CPU ranks, up
    to its processors (the cores share caches, memory bandwidth and clock boost, so a piece is
    profiled with that many copies running at once); 1 with a device per rank."""
    if hardware.compute_slots_per_node is None:
        return 1
    return max(1, min(world_size, hardware.devices_per_node, hardware.compute_slots))


def turn_taking_processors(hardware: HardwareSpec, world_size: int) -> int:
    """The processors of a node a `world_size`-rank job's ranks take turns on (measure_turn_taking
    runs on them); 0 when every rank has one of its own."""
    return hardware.compute_slots if hardware.shares_processors(world_size) else 0


def _measure_in_child(connection, cores, measure) -> None:
    try:
        if hasattr(os, "sched_setaffinity"):  # a copy's own cores, not its parent's (a rank
            os.sched_setaffinity(0, cores)  # bound to one core); the kernel keeps the cpuset
        torch.set_num_threads(1)
        settle_host_allocator()  # as the training ranks do
        connection.send(measure())
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback
        connection.send(traceback.format_exc())
    finally:
        connection.close()
        os._exit(0)  # a forked copy: skip the parent's exit handlers


def _in_copies(measure, cores_per_copy: list, timeout_s: float, what: str) -> list:
    """measure() in one forked copy of this process per entry of `cores_per_copy` (the cores
    that copy may run on), all at the same time; their results in that order."""
    import multiprocessing
    context = multiprocessing.get_context("fork")
    pipes = [context.Pipe(duplex=False) for _ in cores_per_copy]
    children = [context.Process(target=_measure_in_child, args=(sending, cores, measure))
                for (_, sending), cores in zip(pipes, cores_per_copy)]
    for child in children:
        child.start()
    results = []
    for (receiving, sending), child in zip(pipes, children):
        sending.close()
        result = receiving.recv() if receiving.poll(timeout_s) else \
            f"no result within {timeout_s:.0f} s"
        child.join(timeout=10)
        if isinstance(result, str):
            for other in children:
                if other.is_alive():
                    other.kill()
            raise RuntimeError(f"{what} in {len(cores_per_copy)} processes failed: {result}")
        results.append(result)
    return results


def measure_costs_at_once(model: ModelConfig, precision: PrecisionConfig,
                          sizes: list[tuple[int, int]], processes: int = 1,
                          device: torch.device | None = None, timeout_s: float = 600.0
                          ) -> dict[tuple[int, int], dict]:
    """measure_costs for every (t, b) of `sizes`, in `processes` forked copies of this process
    running at the same time (as the job's ranks will; CPU only), each figure the median over
    the copies; with 1, here (a CPU process settling its allocator first, as training ranks do)."""
    copies = measure_costs_per_copy(model, precision, sizes, processes, device, timeout_s)
    return {key: median_record(records) for key, records in copies.items()}


def measure_costs_per_copy(model: ModelConfig, precision: PrecisionConfig,
                           sizes: list[tuple[int, int]], processes: int = 1,
                           device: torch.device | None = None, timeout_s: float = 600.0
                           ) -> dict[tuple[int, int], list[dict]]:
    """measure_costs_at_once before the median: every copy's record (how far copies running at
    the same time differ is how far ranks do)."""
    if processes <= 1:
        settle_host_allocator()  # as the training ranks do
        return {key: [record] for key, record in measure_costs(model, precision, sizes,
                                                              device).items()}
    every_core = list(range(os.cpu_count() or 1))
    results = _in_copies(lambda: measure_costs(model, precision, sizes, device),
                         [every_core] * processes, timeout_s, "profiling")
    return {key: [result[key] for result in results] for key in sizes}


def _layer_processor_seconds(model: ModelConfig, precision: PrecisionConfig,
                             sizes: list[tuple[int, int]], start, seconds: float
                             ) -> dict[tuple[int, int], float]:
    """Per (t, b): the processor seconds of a layer's forward and backward (this thread's, so
    turns taken by other processes do not count), the mean over `seconds` of runs of that size
    alone (a rank runs its own stage's layers over and over, not other shapes; the mean, as only
    the runs a turn interrupts pay), each size begun when every copy has passed `start` (a
    barrier) so that all overlap."""
    device, dtype = torch.device("cpu"), getattr(torch, precision.working_dtype_name)
    modules = _modules_by_t(model, sizes, dtype, device)
    means = {}
    for t, b in sizes:
        backward, forward = _size_pieces(model, modules[t], b, device)[0]["layer_backward_s"]
        forward()
        backward()  # warm-up
        runs = 0
        start.wait()
        began, end = time.thread_time(), time.perf_counter() + seconds
        while time.perf_counter() < end or not runs:
            forward()
            backward()
            runs += 1
        means[(t, b)] = (time.thread_time() - began) / runs
    return means


def measure_turn_taking(model: ModelConfig, precision: PrecisionConfig,
                        sizes: list[tuple[int, int]], processors: int, rounds: int = 3,
                        seconds: float = 0.6, timeout_s: float = 600.0
                        ) -> dict[tuple[int, int], float]:
    """Per (t, b): ComputeCosts.turn_taking_overhead, the median over `rounds` of (a layer's
    processor seconds per forward and backward with two copies of this process bound to each of
    `processors` cores) / (with one copy per core) - 1, the two alternating; CPU only. Linux
    hands a core to each of its runnable processes in turns of a few milliseconds, and each turn
    begins on caches the other process filled: on this VM 9-16% more processor time for the
    planner validation's GPT layer, 3-25% for other shapes, so it is measured on the model."""
    import multiprocessing
    cores = [[core] for core in usable_cores()[:processors]]
    if len(cores) < processors:
        raise ValueError(f"measure_turn_taking: {processors} processors asked for, "
                         f"{len(cores)} usable here")
    context = multiprocessing.get_context("fork")

    def timed(copies: list[list[int]], what: str) -> list[dict]:
        start = context.Barrier(len(copies))  # passed once per size
        return _in_copies(lambda: _layer_processor_seconds(model, precision, sizes, start,
                                                           seconds), copies, timeout_s, what)
    overheads: dict[tuple[int, int], list[float]] = {key: [] for key in sizes}
    for _ in range(rounds):
        alone = timed(cores, "timing a layer alone on each core")
        turns = timed(cores * 2, "timing a layer two per core")
        for key in sizes:
            overheads[key].append(statistics.mean(r[key] for r in turns)
                                  / statistics.mean(r[key] for r in alone) - 1.0)
    return {key: max(statistics.median(values), 0.0) for key, values in overheads.items()}


def measured_profile(model: ModelConfig, precision: PrecisionConfig, hardware: HardwareSpec,
                     micro_batch_sizes: list[int], cache_dir: str | os.PathLike | None = None,
                     device: torch.device | None = None, progress: bool = False,
                     tensor_parallel_sizes: list[int] = (1,),
                     rounds: int = PROFILE_ROUNDS, processes: int = 1,
                     turn_taking_processors: int = 0) -> MeasuredProfile:
    """Measure what the JSON cache does not hold yet (per tensor-parallel and micro batch size)
    and return the profile. Every missing size is measured once per round, the rounds one after
    the other, and each figure is the median over the rounds: on a shared CPU a piece's time
    drifts by 20-40% within seconds, and a process's first measurements run slow. With
    `processes` > 1 (`profiling_processes`) each round runs that many copies at once. With
    `turn_taking_processors` (a job putting more ranks on a node than it has processors, which
    CPU ranks then take turns on) each size also gets its turn_taking_overhead on that many.
    --sequence-parallel changes what a t > 1 shard is fed: it is part of the cached profile's
    identity when such a t is measured (t = 1 alone is the model without it, cached as that).
    Likewise the fp32 softmax flags change nothing in fp32: such a profile is the model's without
    them."""
    analytic = AnalyticProfile(model, precision, hardware)
    if not any(t > 1 for t in tensor_parallel_sizes):
        model = dataclasses.replace(model, sequence_parallel=False)
    if not unfused_attention(model, dtype_bytes(precision)):
        model = dataclasses.replace(model, attention_softmax_in_fp32=False,
                                    apply_query_key_layer_scaling=False)
    path = _cache_path(Path(cache_dir or default_cache_dir()), hardware.name, model, precision,
                       processes)
    try:
        cached = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:  # not JSON (written by hand or cut short): measure again
        cached = {}
    if cached.get("model") != _profile_identity(model) or cached.get("torch") != torch.__version__:
        cached = {}  # measured for another model or torch: measure again and replace the file
    records = {(int(t), int(b)): r for t, sizes in cached.get("tensor_parallel", {}).items()
               for b, r in sizes.items()}
    wanted = sorted({(t, b) for t in {1, *tensor_parallel_sizes} for b in micro_batch_sizes})
    missing = [key for key in wanted if key not in records]
    if missing:
        from tqdm import tqdm
        runs: dict[tuple[int, int], list[dict]] = {key: [] for key in missing}
        with tqdm(total=rounds, desc="profiling", unit="round", disable=not progress) as bar:
            for _ in range(rounds):
                measured = measure_costs_at_once(model, precision, missing, processes, device)
                for key, record in measured.items():
                    runs[key].append(record)
                bar.update()
        records.update({key: median_record(measured) for key, measured in runs.items()})
    untaken = [key for key in wanted if "turn_taking_overhead" not in records[key]] \
        if turn_taking_processors else []
    if untaken:
        for key, overhead in measure_turn_taking(model, precision, untaken,
                                                 turn_taking_processors).items():
            records[key] = {**records[key], "turn_taking_overhead": overhead}
    if missing or untaken:
        path.parent.mkdir(parents=True, exist_ok=True)
        by_t: dict[str, dict] = {}
        for (t, b), record in sorted(records.items()):
            by_t.setdefault(str(t), {})[str(b)] = record
        # whole or not at all: ranks of other jobs may read the cache meanwhile
        partial = path.with_name(f"{path.name}.tmp{os.getpid()}")
        partial.write_text(json.dumps({
            "hardware": hardware.name, "dtype": precision.working_dtype_name,
            "model": _profile_identity(model), "torch": torch.__version__,
            "tensor_parallel": by_t}, indent=1))
        os.replace(partial, path)
    return MeasuredProfile(records, analytic)
