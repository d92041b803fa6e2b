"""The distributed optimizer's state reaches the checkpoint writer shard by shard through host
memory: one shard-sized receive buffer, never the full state gathered onto one device."""
import torch
import torch.distributed as dist

from megatron_2bw.distributed.forked import run_forked
from megatron_2bw.pipeline.flat_layout import FlatLayout, gather_shards


def _gather(rank: int, world: int):
    layout = FlatLayout.build([5, 7, 6], [False, False, False], world)
    layout = FlatLayout(layout.offsets, layout.numels, layout.regions, world, rank)
    full = torch.arange(layout.total, dtype=torch.float32)
    shard = torch.cat([full[a:b] for a, b in layout.owned])
    received = []
    recv = dist.recv

    def recorded_recv(tensor, *args, **kwargs):
        received.append(tensor.numel())
        return recv(tensor, *args, **kwargs)
    dist.recv = recorded_recv
    dist.gather = None  # the gather-to-one-device path is gone
    result = gather_shards(shard, layout, dist.group.WORLD, dst=0)
    if rank != 0:
        return None
    return result.device.type, torch.equal(result, full), received, shard.numel()


def test_shards_stream_to_the_writer_through_one_buffer():
    device, equal, received, shard_numel = run_forked(3, _gather, timeout=120)[0]
    assert device == "cpu" and equal
    assert received == [shard_numel, shard_numel]  # one shard from each other rank
