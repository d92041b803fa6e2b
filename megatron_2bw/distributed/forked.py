"""Run a function on several ranks forked from this process (tests and benchmarks on one machine).

The ranks inherit the parent's imports (a fast start), run with one thread each, and return
picklable results; a failure on any rank raises here with every failed rank's traceback.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_2bw.distributed import strict_p2p
from megatron_2bw.distributed.launch import free_port, settle_host_allocator


def _rank_entry(rank: int, world: int, port: int, out_dir: str, fn, args, backend: str,
                timeout: float):
    torch.set_num_threads(1)
    settle_host_allocator()  # as init_distributed does for a launched rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        strict_p2p.install_from_env()  # the test suite's NCCL rules on gloo
        result = fn(rank, world, *args)
        Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        Path(out_dir, f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_forked(world: int, fn, *args, backend: str = "gloo", timeout: float = 120.0) -> list:
    """fn(rank, world, *args) on `world` forked ranks; the per-rank results, by rank. Every
    collective, and the whole run, is bounded by `timeout` seconds."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_rank_entry, args=(world, free_port(), out_dir, fn, args,
                                                        backend, timeout),
                                     nprocs=world, join=False, start_method="fork")
        deadline = time.time() + timeout
        try:
            while not context.join(timeout=0.5):
                if time.time() > deadline:
                    raise TimeoutError(f"{world} ranks did not finish within {timeout:.0f} s")
        except Exception as error:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            errors = [Path(out_dir, name).read_text() for name in sorted(os.listdir(out_dir))
                      if name.endswith(".err")]
            raise RuntimeError("\n".join(errors) or str(error)) from None
        return [pickle.loads(Path(out_dir, f"{rank}.pkl").read_bytes()) for rank in range(world)]
