"""--manual-gc and --empty-unused-memory-level: collections and cache emptying at fixed points."""
import pytest
import torch

from megatron_2bw.config import TrainingConfig
from megatron_2bw.training.housekeeping import MemoryHousekeeping
from tests.distributed_helpers import run_ranks
from tests.training.runs import TINY, pretrain_recording, steps


FULL, YOUNGEST = ("collect", 2), ("collect", 0)


# validation after iterations 3 and 6, then the test split once training is complete (the
# collector is back on by then)
AUTOMATIC_GC = steps(True, 1, 2, 3) + [("evaluate", True)] + steps(True, 4, 5, 6) + [
    ("evaluate", True), ("evaluate", True)]


@pytest.mark.parametrize("flags,expected", [
    ([], AUTOMATIC_GC),
    (["--manual-gc", "--manual-gc-interval", "2"],
     [FULL, *steps(False, 1, 2), FULL, *steps(False, 3), FULL, ("evaluate", False), YOUNGEST,
      *steps(False, 4), FULL, *steps(False, 5, 6), FULL, FULL, ("evaluate", False), YOUNGEST,
      FULL, ("evaluate", True), YOUNGEST]),
    (["--manual-gc", "--no-manual-gc-eval"],
     [FULL, *steps(False, 1, 2, 3), ("evaluate", False), *steps(False, 4, 5, 6),
      ("evaluate", False), ("evaluate", True)]),
], ids=["automatic", "manual-every-2", "manual-not-around-evaluation"])
def test_manual_gc_collects_only_at_the_interval_and_around_evaluation(flags, expected):
    events, gc_on_after = run_ranks(1, pretrain_recording, [*TINY, *flags])[0]
    assert events == expected
    assert gc_on_after  # the collector is back on once training ends


@pytest.mark.parametrize("level,device,emptied", [
    (0, "cuda", []), (1, "cuda", ["step"]), (2, "cuda", ["step", "evaluation"]),
    (2, "cpu", []),  # nothing to empty without CUDA
])
def test_empty_unused_memory_level_empties_the_cuda_cache(level, device, emptied, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(moment))
    housekeeping = MemoryHousekeeping(
        TrainingConfig(empty_unused_memory_level=level), torch.device(device))
    moment = "step"
    housekeeping.after_step(1)
    moment = "evaluation"
    with housekeeping.around_evaluation():
        pass
    assert calls == emptied
