"""Thread counts of one-process tools on a shared machine, and the note on a busy one."""
import pytest
import torch

from megatron_2bw import cpu_threads
from megatron_2bw.training import startup


@pytest.mark.parametrize("cores,load,threads", [
    (8, 0.1, 8),  # a quiet machine: every core
    (8, 3.0, 5),  # three cores busy with other work
    (2, 7.5, 1),  # more busy than there are cores: still one
    (4, 1.6, 2),
])
def test_a_process_alone_leaves_out_the_cores_others_keep_busy(cores, load, threads):
    assert cpu_threads.single_process_threads(cores, load) == threads


def test_the_threads_are_set_unless_the_user_chose_them(monkeypatch):
    monkeypatch.setattr(cpu_threads, "others_load", lambda: 1.0e9)  # a very busy machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert cpu_threads.set_single_process_threads() == 1
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert cpu_threads.set_single_process_threads() is None
        assert torch.get_num_threads() == before
        # a one-process run (fine-tuning, pretraining without a launcher) takes the same count
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(startup, "local_world_size", lambda: 1)
        startup.set_cpu_threads(bound=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_planning_on_a_busy_machine_is_noted():
    assert cpu_threads.busy_machine_note(cores=2, load=0.4) is None
    note = cpu_threads.busy_machine_note(cores=2, load=3.25)
    assert note.startswith("this machine was busy while planning (1-minute load average 3.2 on 2 "
                           "cores)")


def test_the_busy_note_counts_the_machines_cores_not_a_bound_ranks(monkeypatch):
    import os
    monkeypatch.setattr(cpu_threads, "others_load", lambda: 0.75 * (os.cpu_count() or 1))
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: [0])  # --bind-cores-to-rank: one
    assert f"on {os.cpu_count()} cores" in cpu_threads.busy_machine_note()
