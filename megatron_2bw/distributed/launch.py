"""Start-up: find rank/world from whatever launched the job, pick device and backend, init.

Launchers: torchrun and the deepspeed launcher set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/PORT;
Slurm's srun (one task per device, no torchrun) sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID.
A plain `python script.py` is a world of one.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_2bw.config import ConfigError
from megatron_2bw.distributed import strict_p2p


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist such as 'node[03-05,7],gpu1' -> 'node03'."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        return nodelist
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launch(env=None) -> LaunchInfo:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                          env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                          "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return LaunchInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                          int(env.get("SLURM_LOCALID", 0)), addr,
                          int(env.get("MASTER_PORT", 29500)), "slurm")
    return LaunchInfo(0, 1, 0, "127.0.0.1", free_port(), "single")


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_gpus_for_ranks(local_ranks: int) -> None:
    """One GPU per rank: more ranks on this node than visible GPUs is refused up front (NCCL would
    otherwise fail later on two ranks sharing a GPU), naming the counts and the two ways out."""
    if not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise ConfigError(f"{local_ranks} ranks on this node but {gpus} visible GPU"
                          f"{'s' if gpus != 1 else ''}: start at most {gpus} per node "
                          f"(torchrun --nproc-per-node {gpus}), or hide the GPUs to run every "
                          f"rank on the CPU (CUDA_VISIBLE_DEVICES=)")


def local_world_size(env=None) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else Slurm's tasks per node (e.g. "4" or
    "4(x2)"), else 1."""
    env = os.environ if env is None else env
    value = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE") or "1"
    match = re.match(r"\d+", value)
    return int(match.group()) if match else 1


def usable_cores() -> list[int]:
    """The cores this process may run on (its CPU affinity; every core where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def bind_cores(local_rank: int, local_world: int) -> list[int]:
    """Bind this process (and the threads it starts from now on) to its share of the cores it may
    use: local rank r of n gets the r-th of n equal slices (round-robin single cores when there are
    more ranks than cores), as DeepSpeed's --bind_cores_to_rank does. A rank that stays on its
    cores keeps its caches warm instead of migrating whenever some other thread wakes up (2 CPU
    ranks on 2 cores: 2BW 8% faster here). Returns the cores."""
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("--bind-cores-to-rank needs os.sched_setaffinity (Linux)")
    cores = usable_cores()
    share = max(1, len(cores) // max(local_world, 1))
    start = (local_rank * share) % len(cores)
    mine = cores[start:start + share]
    os.sched_setaffinity(0, mine)
    return mine


# glibc's mallopt parameters (malloc.h) and the state its own heuristic ends in once it has seen
# large blocks freed: blocks up to 32 MiB from the heap, a free heap top kept up to twice that
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_BLOCKS_UP_TO = 32 << 20
_FREE_TOP_KEPT = 64 << 20


def settle_host_allocator() -> bool:
    """Fix glibc malloc's thresholds in a CPU process at the values its own heuristic reaches
    once large tensors have been freed, instead of letting each process's history decide.

    By default glibc maps every block over 128 KiB afresh (the kernel zeroing each page) until a
    freed block raises that threshold; which tensors page-fault then depends on what the process
    happened to allocate first. Measured here: the same GPT head took 13-15 ms in a fresh process
    and 7-9 ms after a larger size had run (33-42k against 4k page faults), so a profile and the
    training it predicts could disagree by 20%; settled, 6-10 ms with no faults once warm.
    Returns whether the settings took (False with CUDA, whose processes keep glibc's defaults;
    off glibc; or when GLIBC_TUNABLES or MALLOC_*_ variables already tune malloc: those are left
    alone)."""
    if torch.cuda.is_available():
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(
            name.startswith("MALLOC_") and name.endswith("_") for name in os.environ):
        return False
    libc_name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(libc_name), "mallopt", None) if libc_name else None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCKS_UP_TO)
                and mallopt(_M_TRIM_THRESHOLD, _FREE_TOP_KEPT))


def init_distributed(backend: str | None, timeout_minutes: float, bind_cores_to_rank: bool = False
                     ) -> tuple[LaunchInfo, torch.device]:
    """Initialise the default process group; every collective is bounded by the timeout. With
    `bind_cores_to_rank` the process is bound first, so the threads it starts inherit the cores.
    A CPU process settles its allocator first (`settle_host_allocator`)."""
    info = detect_launch()
    check_gpus_for_ranks(local_world_size())
    if bind_cores_to_rank:
        bind_cores(info.local_rank, local_world_size())
    device = pick_device(info.local_rank)
    settle_host_allocator()
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", info.master_addr)
        os.environ.setdefault("MASTER_PORT", str(info.master_port))
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size,
                                timeout=timedelta(minutes=timeout_minutes),
                                device_id=device if device.type == "cuda" else None)
        strict_p2p.install_from_env()  # MEGATRON_2BW_STRICT_P2P: the test suite's NCCL rules
    return info, device


def exit_process(code: int) -> None:
    """End a launched process. On success every rank first waits for the others (so none closes
    its connections while another still communicates) and the process groups are destroyed. Then
    exit without interpreter finalization: gloo worker threads that still hold tensors can abort a
    finished run there (SIGABRT), and a failed rank must stop at once so the launcher stops the job."""
    if code == 0 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
