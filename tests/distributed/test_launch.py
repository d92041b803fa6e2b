"""Where a rank learns its place: torchrun and Slurm environments, ranks per node, core binding."""
import multiprocessing as mp
import os

import pytest

from megatron_2bw.distributed.launch import bind_cores, detect_launch, local_world_size


def test_torchrun_and_slurm_environments():
    torchrun = detect_launch({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                              "MASTER_ADDR": "node0", "MASTER_PORT": "1234",
                              "TORCHELASTIC_RUN_ID": "x"})
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.launcher) == \
        (3, 8, 1, "torchrun")
    slurm = detect_launch({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.master_addr) == \
        (5, 8, 1, "gpu07")
    assert detect_launch({}).world_size == 1


def test_ranks_per_node():
    assert local_world_size({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_world_size({"SLURM_NTASKS_PER_NODE": "2(x3)"}) == 2
    assert local_world_size({}) == 1


def _bound(local_rank, local_world, out):
    out.put((bind_cores(local_rank, local_world), sorted(os.sched_getaffinity(0))))


def test_each_local_rank_gets_its_own_share_of_the_cores():
    cores = sorted(os.sched_getaffinity(0))
    context = mp.get_context("fork")  # bind a child, not the test process
    results = []
    for local_rank in range(len(cores) + 1):  # one rank more than cores: round-robin
        out = context.Queue()
        child = context.Process(target=_bound, args=(local_rank, len(cores), out))
        child.start()
        results.append(out.get(timeout=300))
        child.join()
    assert [mine for mine, _ in results] == [[c] for c in cores] + [[cores[0]]]
    assert all(mine == affinity for mine, affinity in results)  # the process is bound to them


def test_binding_without_affinity_support_names_the_flag(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(RuntimeError, match="--bind-cores-to-rank needs os.sched_setaffinity"):
        bind_cores(0, 2)


_WHERE_TENSORS_LIVE = """
import ctypes, sys, torch
from megatron_2bw.distributed.launch import settle_host_allocator
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
took = settle_host_allocator() if sys.argv[1] == "settled" else None
apart = []
for mib in (8, 24, 48):
    before = libc.mallinfo2().hblkhd  # bytes in blocks mapped one by one
    tensor = torch.empty(mib << 20, dtype=torch.uint8)
    apart.append(libc.mallinfo2().hblkhd - before >= mib << 20)
    del tensor
print(took, *apart)
"""


def _where_tensors_live(mode: str, env_update: dict | None = None) -> list[str]:
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(env_update or {})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _WHERE_TENSORS_LIVE, mode], env=env, cwd=root,
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def _glibc_with_mallinfo2() -> bool:
    import ctypes
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


needs_glibc = pytest.mark.skipif(not _glibc_with_mallinfo2(),
                                 reason="the check reads glibc's mallinfo2 (glibc 2.33+)")


@needs_glibc
def test_a_settled_allocator_keeps_tensors_up_to_32_mib_on_the_heap():
    # glibc's default in a fresh process maps 8 and 24 MiB blocks one by one (each page faulted
    # in and zeroed on every allocation); settled, both come from the reusable heap
    assert _where_tensors_live("default") == ["None", "True", "True", "True"]
    assert _where_tensors_live("settled") == ["True", "False", "False", "True"]


@needs_glibc
def test_a_user_malloc_setting_is_left_alone():
    took, *_ = _where_tensors_live("settled", {"MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert took == "False"


def test_more_ranks_on_a_node_than_gpus_is_refused_up_front_naming_the_counts():
    """pretrain_gpt.py as torchrun's rank 0 of 2 on a node with one (faked) GPU: exit code 2 and
    one line naming both counts, before any process group or NCCL communicator exists."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fake_one_gpu = ("import runpy, sys, torch; torch.cuda.is_available = lambda: True; "
                    "torch.cuda.device_count = lambda: 1; sys.argv = sys.argv[1:]; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "PYTHONPATH": root}
    job = subprocess.run([sys.executable, "-c", fake_one_gpu, "pretrain_gpt.py",
                          "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                          "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size",
                          "4", "--mock-data", "--vocab-size", "64", "--train-iters", "1",
                          "--lr", "1e-3"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    assert job.returncode == 2, job.stderr
    assert "2 ranks on this node but 1 visible GPU:" in job.stderr, job.stderr
    assert "Traceback" not in job.stderr
