"""The RNG tracker on a machine with a GPU."""
import torch

from megatron_2bw.tensor_parallel.random import RngTracker


def test_a_rank_forked_after_its_parent_used_cuda_tracks_no_cuda_state(monkeypatch):
    """Such a rank (the suite forks CPU ranks, also on a GPU machine) cannot start CUDA: reading
    its RNG state would raise "Cannot re-initialize CUDA in forked subprocess"."""
    def no_cuda_here():
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", no_cuda_here)
    tracker = RngTracker()
    tracker.add("tensor-parallel", 7)
    with tracker.fork():
        inside = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(inside, torch.rand(3))  # the forked state is the seed's, on the CPU
