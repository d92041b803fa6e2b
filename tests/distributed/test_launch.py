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
        results.append(out.get(timeout=30))
        child.join()
    assert [mine for mine, _ in results] == [[c] for c in cores] + [[cores[0]]]
    assert all(mine == affinity for mine, affinity in results)  # the process is bound to them


def test_binding_without_affinity_support_names_the_flag(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(RuntimeError, match="--bind-cores-to-rank needs os.sched_setaffinity"):
        bind_cores(0, 2)


_FAULTS_OF_A_LOSS_HEAD = """
import resource, sys, torch
from megatron_2bw.distributed.launch import settle_host_allocator
took = settle_host_allocator() if sys.argv[1] == "settled" else None
torch.manual_seed(0)
x = torch.randn(256, 128, requires_grad=True)
w = torch.randn(4096, 128, requires_grad=True)
def step():  # 4 MiB of logits and their softmax, made and freed every step
    torch.log_softmax(x @ w.t(), -1).mean().backward()
for _ in range(2):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str, env_update: dict | None = None) -> tuple[str, int]:
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(env_update or {})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _FAULTS_OF_A_LOSS_HEAD, mode], env=env, cwd=root,
                         capture_output=True, text=True, check=True)
    took, faults = out.stdout.split()
    return took, int(faults)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="glibc malloc is Linux's")
def test_a_settled_allocator_reuses_freed_tensors():
    _, default_faults = _page_faults("default")
    took, settled_faults = _page_faults("settled")
    assert took == "True"
    assert settled_faults < 0.6 * default_faults  # here: about 3.6k against 8-13k


def test_a_user_malloc_setting_is_left_alone():
    took, _ = _page_faults("settled", {"MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert took == "False"
