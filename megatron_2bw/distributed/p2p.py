"""Point-to-point transfers between neighbouring pipeline stages.

Shapes are known ahead (micro batch x sequence x hidden, in the working precision), so there is no
per-message handshake. Consecutive transfers are posted together (batch_isend_irecv); sends are never
waited for on the spot (only before the end of a segment), receives are waited for with the
distributed timeout, so a stalled peer ends in an error naming the transfer instead of a hang.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class P2PTimeout(RuntimeError):
    pass


class PipelineP2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, group, shape: tuple,
                 dtype: torch.dtype, device: torch.device, timeout_minutes: float):
        self.prev_rank, self.next_rank, self.group = prev_rank, next_rank, group
        self.shape, self.dtype, self.device = shape, dtype, device
        self.timeout = timedelta(minutes=timeout_minutes)
        self._sends: list = []

    def exchange(self, sends: list[tuple[str, torch.Tensor]], recvs: list[str]) -> list[torch.Tensor]:
        """Post the sends ("act" to the next stage, "grad" to the previous one) and receives ("act"
        from the previous stage, "grad" from the next one); return the received tensors."""
        ops, buffers = [], []
        for kind, tensor in sends:
            peer = self.next_rank if kind == "act" else self.prev_rank
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, self.group))
        for kind in recvs:
            peer = self.prev_rank if kind == "act" else self.next_rank
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            buffers.append(buffer)
            ops.append(dist.P2POp(dist.irecv, buffer, peer, self.group))
        works = dist.batch_isend_irecv(ops) if len(ops) > 1 else [ops[0].op(
            ops[0].tensor, ops[0].peer, ops[0].group)]
        self._sends.extend(zip(works[:len(sends)], [t for _, t in sends]))
        for work, kind in zip(works[len(sends):], recvs):
            if not work.wait(self.timeout):
                raise P2PTimeout(f"receive of {kind} timed out")
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        return buffers

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait(self.timeout)
        self._sends.clear()
