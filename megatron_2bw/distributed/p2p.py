"""Point-to-point transfers between neighbouring pipeline stages.

Shapes are known ahead (micro batch x sequence x hidden, in the working precision), so there is no
per-message handshake. Consecutive transfers are posted together (batch_isend_irecv); sends are never
waited for on the spot. Every wait is a plain `work.wait()`: under NCCL that only makes the current
stream wait for the transfer (the host runs on and queues the next kernels), where a wait with a
timeout would block the host thread until the transfer is done. A stalled peer still ends the job:
the process group's own timeout (--distributed-timeout-minutes; gloo's per-operation timeout, NCCL's
watchdog) fails the transfer, and the executor names the rank, stage and action.

A send's tensor must stay alive until the send completes, and gloo reports a send complete only
once it has been waited for (`is_completed()` stays False after the data has left). So an exchange
that sends first waits for the sends before the previous sending exchange: their receivers have
long posted the receives (they get there needing nothing this stage has not sent yet), and a
segment of any length holds the tensors of at most two sending exchanges, not of every send.

Under gloo a send is a rendezvous: its data leaves once the receiver has posted the matching
receive. Posted later, the data is pushed by the sender's background thread, which competes for
the core with the sender's computing main thread, so it may arrive milliseconds late (a 2-stage
1F1B here alternated between 0.4 and 2-3 ms per exchange). So under gloo each receive is posted
one ahead, as soon as the previous one of its kind has arrived, when the executor has said how
many the segment holds (`expect`). Not under NCCL: a pending receive would hold the
communicator's stream, and the sends queued behind it would never start.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# "act" runs down the ranks (to the next), "grad" up; under a V, chunk 1's activations run up
# ("act_up") and its gradients down ("grad_down")
KINDS = ("act", "grad", "act_up", "grad_down")
DOWN = {"act": True, "grad": False, "act_up": False, "grad_down": True}
# two ranks may exchange several kinds (interleaved at p = 2: both neighbours are the same rank;
# a V's pairs always), and a receive posted ahead must match a send of its own kind
TAGS = {kind: tag for tag, kind in enumerate(KINDS)}


class PipelineP2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, group, shape: tuple,
                 dtype: torch.dtype, device: torch.device, post_ahead: bool | None = None):
        self.prev_rank, self.next_rank, self.group = prev_rank, next_rank, group
        self.shape, self.dtype, self.device = shape, dtype, device
        self.post_ahead = (dist.get_backend(group) == "gloo") if post_ahead is None else post_ahead
        self._sends: list[list] = []  # per sending exchange, oldest first: (work, tensor) of its sends
        self._expected = dict.fromkeys(KINDS, 0)  # receives of the segment not yet posted
        self._ahead: dict[str, tuple] = {}  # kind -> (work, buffer) of the receive posted ahead

    def _source(self, kind: str) -> int:
        return self.prev_rank if DOWN[kind] else self.next_rank

    def _destination(self, kind: str) -> int:
        return self.next_rank if DOWN[kind] else self.prev_rank

    def expect(self, receives: dict[str, int]) -> None:
        """The number of receives of each kind (KINDS) the coming segment makes; under
        gloo the first of each is posted now, and each next one when its predecessor arrives."""
        if self._ahead or any(self._expected.values()):
            raise RuntimeError(f"receives of the previous segment still pending: {self._expected}")
        self._expected = {kind: receives.get(kind, 0) for kind in KINDS}
        for kind in KINDS:
            self._post_ahead(kind)

    def _post_ahead(self, kind: str) -> None:
        if self.post_ahead and self._expected[kind] > 0:
            self._expected[kind] -= 1
            buffer = self._buffer()
            self._ahead[kind] = (dist.irecv(buffer, self._source(kind), self.group,
                                            tag=TAGS[kind]), buffer)

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def exchange(self, sends: list[tuple[str, torch.Tensor]], recvs: list[str]) -> list[torch.Tensor]:
        """Post the sends ("act", "grad_down" to the next stage, "grad", "act_up" to the previous
        one) and receives (from where those come); return the received tensors."""
        if sends:
            self._retire_sends(keep=1)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), self._destination(kind), self.group,
                          TAGS[kind]) for kind, tensor in sends]
        posted: list[tuple] = []  # per receive: (its work, None if posted below; buffer)
        for kind in recvs:
            if kind in self._ahead:
                posted.append(self._ahead.pop(kind))
                continue
            self._expected[kind] = max(0, self._expected[kind] - 1)
            buffer = self._buffer()
            posted.append((None, buffer))
            ops.append(dist.P2POp(dist.irecv, buffer, self._source(kind), self.group, TAGS[kind]))
        works = []
        if ops:
            works = dist.batch_isend_irecv(ops) if len(ops) > 1 else [ops[0].op(
                ops[0].tensor, ops[0].peer, ops[0].group, ops[0].tag)]
            if len(works) == 1 < len(ops):  # NCCL coalesces a batch into one work for all ops
                works = works * len(ops)
        if sends:
            self._sends.append(list(zip(works[:len(sends)], [t for _, t in sends])))
        posted_now = iter(works[len(sends):])
        buffers = []
        for (work, buffer), kind in zip(posted, recvs):
            work = next(posted_now) if work is None else work
            work.wait()  # the group's timeout ends a stalled peer
            buffers.append(buffer)
            self._post_ahead(kind)
        return buffers

    def _retire_sends(self, keep: int) -> None:
        """Wait for the sends of all but the last `keep` exchanges and drop their tensors."""
        while len(self._sends) > keep:
            for work, _ in self._sends.pop(0):
                work.wait()

    def pending_sends(self) -> int:
        return sum(map(len, self._sends))

    def wait_sends(self) -> None:
        self._retire_sends(keep=0)
