"""Thread counts on a shared CPU machine, and whether it is busy enough to skew measurements.

torch starts one thread per core. A tool that runs in one process on a machine others are using
then has threads waiting for each other at every parallel region, slower than fewer threads
would be. Ranks of a launched job get their share of the cores instead (training.set_cpu_threads).
"""
from __future__ import annotations

import os

import torch

from megatron_2bw.distributed.launch import usable_cores

# other processes keeping more than this share of the cores busy make a profile unrepresentative
BUSY_SHARE = 0.5


def others_load() -> float:
    """Cores other processes keep busy: the 1-minute load average (this process, just started,
    adds next to nothing to it)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def single_process_threads(cores: int | None = None, load: float | None = None) -> int:
    """Threads for a tool alone in its process: the cores it may use less those other processes
    keep busy, at least one."""
    cores = len(usable_cores()) if cores is None else cores
    load = others_load() if load is None else load
    return max(1, min(cores, round(cores - load)))


def set_single_process_threads() -> int | None:
    """torch's CPU threads for a one-process tool (an OMP_NUM_THREADS the user set is kept; GPU
    runs are left alone); returns the count set, or None."""
    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ:
        return None
    threads = single_process_threads()
    torch.set_num_threads(threads)
    return threads


def busy_machine_note(cores: int | None = None, load: float | None = None) -> str | None:
    """A line for measurements taken now (the planner's profile) when other processes keep over
    BUSY_SHARE of the machine's cores busy (all of them: the load average is the machine's, and
    a rank bound to its share sees only that); None on a quiet machine."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    load = others_load() if load is None else load
    if load <= BUSY_SHARE * cores:
        return None
    return (f"this machine was busy while planning (1-minute load average {load:.1f} on {cores} "
            f"cores): measured costs and the predicted throughput describe a loaded machine; plan "
            f"again when it is quiet, or pin the layout with flags")
