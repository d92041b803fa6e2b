"""No host waits on the device path in the steady state: a real 2-stage, 2-replica run with every
host-synchronising tensor call counted (on a GPU each would stall the host until the device caught
up; tests/gpu checks the same with torch.cuda.set_sync_debug_mode("error")).

Per optimizer step a stage reads the batch's metrics and the gradient norm (one transfer each, as
Megatron-LM reads its norm); nothing per microbatch, so the count per step is the same with twice
the microbatches. No wait on the device's work passes a host timeout (the process group's timeout
and watchdog bound it instead)."""
import collections

import pytest
import torch
import torch.distributed as dist

from megatron_2bw.distributed import strict_p2p
from megatron_2bw.distributed.forked import run_forked
from megatron_2bw.training.segments import run_segment
from tests.pipeline.harness import gpt_feed, stage_on_rank, tiny_config

SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "numpy")
BATCHES = 5
STEADY = slice(2, None)  # 2BW's first steps come at its warm-up


def _count(rank: int, world: int, global_batch: int, optimizer: str = "adam",
           sharded: bool = False):
    # strict transfers (distributed/strict_p2p.py) read each message's header on the host and
    # bound their waits: test machinery this count must not see (every rank, before any transfer)
    strict_p2p.uninstall()
    config = tiny_config(p=2, global_batch=global_batch, micro=2, optimizer=optimizer, layers=2,
                         vocab_size=61)  # padded to 64: the last rows are padding
    config.parallel.use_distributed_optimizer = sharded
    config.training.calculate_per_token_loss = True
    calls = collections.Counter()
    after_step = []
    layout, stage = stage_on_rank(rank, world, config,
                                  on_step=lambda result: after_step.append(sum(calls.values())))
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)
        setattr(torch.Tensor, name, counted)
    original_wait = dist.Work.wait

    def wait(self, *args, **kwargs):
        if args or kwargs:
            calls["wait with a host timeout"] += 1
        return original_wait(self, *args, **kwargs)
    dist.Work.wait = wait
    run_segment(stage, 0, BATCHES, gpt_feed(config, layout))
    per_step = [b - a for a, b in zip(after_step, after_step[1:])]
    return per_step[STEADY], calls["wait with a host timeout"]


@pytest.mark.parametrize("optimizer,sharded", [("adam", False),
                                               ("muon", True)])  # Muon's whole-matrix gathers
def test_the_steady_state_reads_the_device_twice_per_step_and_never_per_microbatch(optimizer,
                                                                                  sharded):
    two = run_forked(4, _count, 8, optimizer, sharded, timeout=120)  # m = 2 per replica
    four = run_forked(4, _count, 16, optimizer, sharded, timeout=120)  # m = 4
    for (per_step, timed_waits), (per_step_4, timed_waits_4) in zip(two, four):
        assert timed_waits == timed_waits_4 == 0
        assert per_step == per_step_4
        assert max(per_step) <= 2, per_step
