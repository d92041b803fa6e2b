"""Point-to-point transfers between neighbouring pipeline stages.

Shapes are known ahead (micro batch x sequence x hidden, in the working precision), so there is no
per-message handshake. Every exchange, one transfer or several, is posted in one form on every
backend: `batch_isend_irecv`. NCCL runs a batched transfer on the group's communicator and a single
`isend`/`irecv` on a separate two-rank one, so a send posted in one form never meets a receive
posted in the other; a receive is posted with the exchange the schedule puts it in, never ahead
(docs/schedules.md, "NCCL's rules and how the pipeline keeps them"). Tags only make the traffic
readable: NCCL ignores them, so a pair's transfers match in posting order, which the schedules
keep (schedules.validate, pipeline/nccl_replay.py).

Sends are never waited for on the spot. Every wait is a plain `work.wait()`: under NCCL that only
makes the current stream wait for the transfer (the host runs on and queues the next kernels),
where a wait with a timeout would block the host thread until the transfer is done. A stalled
peer still ends the job: the process group's own timeout (--distributed-timeout-minutes; gloo's
per-operation timeout, NCCL's watchdog) fails the transfer, and the executor names the rank, stage
and action.

A send's tensor must stay alive until the send completes, and gloo reports a send complete only
once it has been waited for (`is_completed()` stays False after the data has left). So an exchange
that sends first waits for the sends before the previous sending exchange: their receivers have
long posted the receives (they get there needing nothing this stage has not sent yet), and a
segment of any length holds the tensors of at most two sending exchanges, not of every send.
"""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from megatron_2bw.distributed.strict_p2p import labelled

KINDS = ("act", "grad")
TAGS = {"act": 0, "grad": 1}


class PipelineP2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, group, shape: tuple,
                 dtype: torch.dtype, device: torch.device):
        self.prev_rank, self.next_rank, self.group = prev_rank, next_rank, group
        self.shape, self.dtype, self.device = shape, dtype, device
        self._sends: list[list] = []  # per sending exchange, oldest first: (work, tensor) of its sends

    def _source(self, kind: str) -> int:
        return self.prev_rank if kind == "act" else self.next_rank

    def _destination(self, kind: str) -> int:
        return self.next_rank if kind == "act" else self.prev_rank

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def exchange(self, sends: list[tuple[str, torch.Tensor]], recvs: list[str],
                 labels: list[tuple[int, int]] | None = None) -> list[torch.Tensor]:
        """Post the sends ("act" to the next stage, "grad" to the previous one) and receives ("act"
        from the previous stage, "grad" from the next one) as one batch; return the received
        tensors. `labels`: (microbatch, chunk) of each send then each receive, which a strict
        transport (strict_p2p.py, in tests) checks at the receiving end."""
        if sends:
            self._retire_sends(keep=1)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), self._destination(kind), self.group,
                          TAGS[kind]) for kind, tensor in sends]
        buffers = [self._buffer() for _ in recvs]
        ops += [dist.P2POp(dist.irecv, buffer, self._source(kind), self.group, TAGS[kind])
                for kind, buffer in zip(recvs, buffers)]
        if not ops:
            return []
        with labelled(labels):
            works = dist.batch_isend_irecv(ops)
        if len(works) == 1 < len(ops):  # NCCL coalesces a batch into one work for all ops
            works = works * len(ops)
        if sends:
            self._sends.append(list(zip(works[:len(sends)], [op.tensor for op in ops])))
        for work in works[len(sends):]:
            work.wait()  # the group's timeout ends a stalled peer
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


def _one_batch(op, tensor: torch.Tensor, peer: int, group) -> None:
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)]):
        work.wait()


def send_object(obj, dst: int, device: torch.device, group=None) -> None:
    """Blocking transfer of a picklable object to global rank `dst` (its size, then its bytes),
    in the pipeline's one form: batch_isend_irecv."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    _one_batch(dist.isend, torch.tensor([data.numel()], device=device), dst, group)
    _one_batch(dist.isend, data, dst, group)


def recv_object(src: int, device: torch.device, group=None):
    """The object `send_object` sent from global rank `src`."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _one_batch(dist.irecv, size, src, group)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _one_batch(dist.irecv, data, src, group)
    return pickle.loads(data.cpu().numpy().tobytes())

