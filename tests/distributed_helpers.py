"""Run a function on several gloo ranks from inside pytest (forked processes, 1 thread each)."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, out_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 120.0) -> list:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results (picklable)."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir),
                                     nprocs=world_size, join=False, start_method="fork")
        deadline = time.time() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.time() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"ranks did not finish within {timeout} s")
        except Exception as error:
            errors = [open(os.path.join(out_dir, name)).read() for name in sorted(os.listdir(out_dir))
                      if name.endswith(".err")]
            raise AssertionError("\n".join(errors) or str(error)) from None
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
