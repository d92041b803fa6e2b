"""Strict point-to-point transfers: gloo made to keep NCCL's rules, for the multi-process tests.

Gloo honours tags, buffers a posted send and serves every form of transfer alike, so a pipeline
that would hang or swap data under NCCL passes on CPU. With MEGATRON_2BW_STRICT_P2P=1 (the test
suite sets it; `install_from_env` runs when a rank's process group starts) torch.distributed's
isend, irecv, send, recv and batch_isend_irecv are replaced in this process by versions that
behave as NCCL does where it matters:

- form: every message carries a small header naming how it was posted (a single isend/irecv, or
  inside batch_isend_irecv); a receive posted in the other form fails naming both ranks and both
  transfers (NCCL runs the two forms on different communicators: they never meet);
- order: all strict traffic of a group goes on one gloo tag, so a pair's messages match in posting
  order whatever their tags (NCCL ignores tags); the receiver checks the header's tag and, where
  the poster labelled the transfer (`labelled`: the pipeline's microbatch and chunk), the label
  against what it expected;
- rendezvous: a rank's transfers on one communicator (the group's, for batches; the pair's, for
  single ones) run in posting order, each starting once the previous has completed, and a send
  completes only once its receive is posted: a cycle of ranks each waiting on a send deadlocks,
  and the group's timeout ends it with a message naming the transfer and the peer.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "MEGATRON_2BW_STRICT_P2P"
TAG = 7919  # the one gloo tag of strict traffic
SINGLE, BATCHED = 1, 2
FORMS = {SINGLE: "a single isend/irecv", BATCHED: "batch_isend_irecv"}
HEADER = 5  # int64 words: form, tag, microbatch, chunk, sender (global rank)
_ORIGINAL: dict = {}
_labels = threading.local()
_pending: dict = {}  # communicator key -> this rank's strict works posted on it, oldest first


def installed() -> bool:
    return bool(_ORIGINAL)


def install_from_env() -> None:
    """Install when MEGATRON_2BW_STRICT_P2P is set (to anything but 0) and the default group
    runs on gloo (NCCL keeps its own rules)."""
    if os.environ.get(ENV, "0") not in ("", "0") and dist.is_initialized() and \
            dist.get_backend() == "gloo":
        install()


def install() -> None:
    if installed():
        return
    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv"):
        _ORIGINAL[name] = getattr(dist, name)
    dist.isend = c10d.isend = _strict_isend
    dist.irecv = c10d.irecv = _strict_irecv  # c10d's: P2POp accepts only its module's functions
    dist.send, dist.recv = _strict_send, _strict_recv
    dist.batch_isend_irecv = _strict_batch_isend_irecv


def uninstall() -> None:
    if not installed():
        return
    dist.isend = c10d.isend = _ORIGINAL["isend"]
    dist.irecv = c10d.irecv = _ORIGINAL["irecv"]
    dist.send, dist.recv = _ORIGINAL["send"], _ORIGINAL["recv"]
    dist.batch_isend_irecv = _ORIGINAL["batch_isend_irecv"]
    _ORIGINAL.clear()
    _pending.clear()


@contextmanager
def labelled(labels: list[tuple[int, int]] | None):
    """Label the transfers of the next batch_isend_irecv, in op order, by (microbatch, chunk):
    the receiving end checks the sender's label against its own. Nothing when not installed."""
    if labels is None or not installed():
        yield
        return
    _labels.value = labels
    try:
        yield
    finally:
        _labels.value = None


class StrictP2PError(RuntimeError):
    """A transfer NCCL would not match as gloo did (form, order) or one that never completed."""


class _Transfer:
    """One posted strict transfer: what the messages name it by, and its wire buffer."""

    def __init__(self, is_send: bool, tensor: torch.Tensor, peer: int, group, tag: int,
                 form: int, label: tuple[int, int] | None):
        self.is_send, self.tensor, self.peer, self.group = is_send, tensor, peer, group
        self.tag, self.form = tag, form
        self.microbatch, self.chunk = label if label is not None else (-1, -1)
        self.me = dist.get_rank()
        payload = tensor.nbytes
        self.wire = torch.empty(HEADER * 8 + payload, dtype=torch.uint8)
        if is_send:
            header = torch.tensor([form, tag, self.microbatch, self.chunk, self.me])
            self.wire[:HEADER * 8] = header.view(torch.uint8)
            data = tensor.detach().contiguous().cpu().reshape(-1)
            self.wire[HEADER * 8:] = data.view(torch.uint8)

    def describe(self, form=None, tag=None, microbatch=None, chunk=None, rank=None) -> str:
        form, tag = form or self.form, self.tag if tag is None else tag
        microbatch = self.microbatch if microbatch is None else microbatch
        chunk = self.chunk if chunk is None else chunk
        sender = rank is not None or self.is_send
        what = f"{'send' if sender else 'recv'}(tag {tag}"
        if microbatch >= 0:
            what += f", microbatch {microbatch}, chunk {chunk}"
        return f"{what}) posted as {FORMS[form]}"

    def check_received(self) -> None:
        form, tag, microbatch, chunk, sender = self.wire[:HEADER * 8].view(torch.int64).tolist()
        theirs = self.describe(form, tag, microbatch, chunk, rank=sender)
        mine = f"rank {self.me}'s {self.describe()}"
        if form != self.form:
            raise StrictP2PError(f"rank {sender}'s {theirs} was matched by {mine}: NCCL runs the "
                                 f"two forms on different communicators, so these never match "
                                 f"(a hang)")
        labelled_both = microbatch >= 0 and self.microbatch >= 0
        if tag != self.tag or (labelled_both and (microbatch, chunk) != (self.microbatch,
                                                                        self.chunk)):
            raise StrictP2PError(f"rank {sender}'s {theirs} was matched by {mine}: NCCL matches a "
                                 f"pair's transfers in posting order whatever their tags, so the "
                                 f"receives are posted in another order than the sends")
        payload = self.wire[HEADER * 8:].view(self.tensor.dtype).view(self.tensor.shape)
        self.tensor.copy_(payload)


class _StrictWork:
    def __init__(self, transfer: _Transfer, work, key):
        self.transfer, self.work, self.key, self.done = transfer, work, key, False

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        t = self.transfer
        try:
            self.work.wait(_group_timeout(t.group) if timeout is None else timeout)
        except RuntimeError as error:
            what = f"rank {t.me}'s {t.describe()} {'to' if t.is_send else 'from'} rank {t.peer}"
            if "Timed out" not in str(error):
                raise StrictP2PError(f"{what} failed: {error}") from error
            waiting = "its receive" if t.is_send else "its send"
            raise StrictP2PError(f"{what} did not complete: rank {t.peer} never posted {waiting} "
                                 f"within the group's timeout (under NCCL a cycle of ranks each "
                                 f"waiting on a transfer deadlocks) ({error})") from error
        self.done = True
        pending = _pending.get(self.key, [])
        if self in pending:
            pending.remove(self)
        if not t.is_send:
            t.check_received()
        return True

    def is_completed(self) -> bool:
        return self.done

    def is_success(self) -> bool:
        return self.done


def _group_timeout(group):
    group = group if group is not None else c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout


def _global_peer(group, peer, group_peer) -> int:
    if peer is not None:
        return peer
    return dist.get_global_rank(group, group_peer) if group is not None else group_peer


def _wait_previous(key) -> None:
    """The communicator runs its transfers in order: the previous ones complete first."""
    for work in list(_pending.get(key, [])):
        work.wait()


def _post(transfers: list[_Transfer], key) -> list[_StrictWork]:
    _wait_previous(key)
    works = []
    for t in transfers:
        function = _ORIGINAL["isend" if t.is_send else "irecv"]
        work = function(t.wire, t.peer, group=t.group, tag=TAG)
        works.append(_StrictWork(t, work, key))
    _pending.setdefault(key, []).extend(works)
    return works


def _group_key(group):
    return c10d._get_default_group() if group is None else group


def _single(is_send: bool, tensor, peer, group, tag, group_peer) -> _StrictWork:
    if peer is None and group_peer is None:
        raise StrictP2PError("strict P2P: a receive from any source cannot be matched in order")
    peer = _global_peer(group, peer, group_peer)
    transfer = _Transfer(is_send, tensor, peer, group, tag, SINGLE, None)
    return _post([transfer], ("single", min(peer, transfer.me), max(peer, transfer.me)))[0]


def _strict_isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _single(True, tensor, dst, group, tag, group_dst)


def _strict_irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return _single(False, tensor, src, group, tag, group_src)


def _strict_send(tensor, dst=None, group=None, tag=0, group_dst=None):
    _strict_isend(tensor, dst, group, tag, group_dst).wait()


def _strict_recv(tensor, src=None, group=None, tag=0, group_src=None):
    work = _strict_irecv(tensor, src, group, tag, group_src)
    work.wait()
    return work.transfer.peer


def _strict_batch_isend_irecv(ops) -> list[_StrictWork]:
    labels = getattr(_labels, "value", None)
    _labels.value = None
    transfers = []
    for i, op in enumerate(ops):
        is_send = op.op in (_strict_isend, _ORIGINAL["isend"])
        label = labels[i] if labels is not None else None
        transfers.append(_Transfer(is_send, op.tensor, op.peer, op.group, op.tag, BATCHED, label))
    return _post(transfers, ("batch", id(_group_key(ops[0].group))))
