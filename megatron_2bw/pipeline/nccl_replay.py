"""Replay of the stages' action lists under NCCL's point-to-point rules (`schedules.timeline`
replays them as gloo runs them: sends that never block).

What NCCL does with the executor's transfers, and what this replay models:
- the executor posts the transfers between two computes as one exchange (`transfer_batches`);
  a batch runs on the group's communicator, a single isend/irecv on the pair's; a transfer is
  matched only by one of the same form (`form`: every exchange is batched in the runtime);
- NCCL ignores tags: the n-th send from stage a to stage b on a communicator meets the n-th
  receive of b from a there, whatever it carries; a pair whose kind, microbatch or chunk differ
  is a mismatched transfer (data handed to the wrong microbatch);
- a stage's exchanges run one after the other on its stream, and an exchange completes only once
  each of its transfers has met its counterpart in the peer's running exchange: a send blocks
  until its receive is posted, so ranks waiting on each other in a cycle deadlock.
`check` raises ScheduleError naming the stages of a deadlock and the transfers they wait on, or
the first mismatched transfer; `replay` returns the counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.actions import send_destination, transfer_peer

BATCHED, SINGLE = "batch_isend_irecv", "a single isend/irecv"


def batched(batch: list[S.Action]) -> str:
    """The runtime's form (distributed/p2p.py): every exchange is one batch_isend_irecv."""
    return BATCHED


@dataclass(frozen=True)
class Transfer:
    stage: int
    position: int  # in the stage's action list
    action: S.Action
    peer: int
    form: str
    label: tuple[str, int, int]  # what it carries: (send kind, microbatch, the sending chunk)

    @property
    def is_send(self) -> bool:
        return self.action.kind in (S.SEND_ACT, S.SEND_GRAD)

    def __str__(self) -> str:
        return f"stage {self.stage} action {self.position} ({self.action}, {self.form})"


@dataclass
class ReplayResult:
    transfers: int = 0
    mismatched: list[tuple[Transfer, Transfer]] = field(default_factory=list)  # by order
    other_form: list[tuple[Transfer, Transfer]] = field(default_factory=list)  # by content
    deadlock: str | None = None


def transfer_batches(stage_list: list[S.Action], stage: int, stages: int,
                     form: Callable[[list[S.Action]], str] = batched,
                     shape: str = "loop") -> list[list[Transfer]]:
    """The stage's exchanges in posting order: the transfers between two other actions, posted
    together (StageExecutor._flush_comm)."""
    result, current = [], []

    def transfer(i: int, a: S.Action, how: str) -> Transfer:
        if a.kind in (S.SEND_ACT, S.SEND_GRAD):
            peer = send_destination(stage, a.kind, stages, a.chunk, shape)
            return Transfer(stage, i, a, peer, how, (a.kind, a.microbatch, a.chunk))
        peer, kind, chunk = transfer_peer(stage, a.kind, a.chunk, stages, shape)
        return Transfer(stage, i, a, peer, how, (kind, a.microbatch, chunk))

    def close():
        if current:
            how = form([a for _, a in current])
            result.append([transfer(i, a, how) for i, a in current])
            current.clear()
    for i, a in enumerate(stage_list):
        if a.kind in S.COMM_KINDS:
            current.append((i, a))
        else:
            close()
    close()
    return result


def replay(actions: list[list[S.Action]], form: Callable[[list[S.Action]], str] = batched,
           shape: str = "loop") -> ReplayResult:
    """`shape`: where the chunks sit (placement.py), which decides each transfer's peer."""
    stages = len(actions)
    batches = [transfer_batches(row, s, stages, form, shape) for s, row in enumerate(actions)]
    result = ReplayResult(transfers=sum(len(b) for row in batches for b in row))
    where: dict[Transfer, int] = {}  # transfer -> index of its batch on its stage
    channels: dict[tuple, list[list[Transfer]]] = {}  # (src, dst, form) -> [sends, receives]
    by_content: dict[tuple, list[list[Transfer]]] = {}  # (src, dst, label) -> [sends, receives]
    for s, row in enumerate(batches):
        for index, batch in enumerate(row):
            for t in batch:
                where[t] = index
                src, dst = (s, t.peer) if t.is_send else (t.peer, s)
                side = 0 if t.is_send else 1
                channels.setdefault((src, dst, t.form), [[], []])[side].append(t)
                by_content.setdefault((src, dst, t.label), [[], []])[side].append(t)
    match: dict[Transfer, Transfer] = {}
    for sends, recvs in channels.values():
        for send, recv in zip(sends, recvs):
            match[send], match[recv] = recv, send
            if send.label != recv.label:
                result.mismatched.append((send, recv))
    for sends, recvs in by_content.values():
        result.other_form += [(a, b) for a, b in zip(sends, recvs) if a.form != b.form]
    done: set[Transfer] = set()
    position = [0] * stages  # each stage's running batch
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while position[s] < len(batches[s]):
                for t in batches[s][position[s]]:
                    peer = match.get(t)
                    if t not in done and peer is not None and \
                            position[peer.stage] == where[peer]:
                        done.update((t, peer))
                        progress = True
                if not all(t in done for t in batches[s][position[s]]):
                    break
                position[s] += 1
                progress = True
    stuck = [s for s in range(stages) if position[s] < len(batches[s])]
    if stuck:
        result.deadlock = "; ".join(_waits(batches[s][position[s]], match, done, position, batches)
                                    for s in stuck)
    return result


def _waits(batch: list[Transfer], match: dict, done: set, position: list[int],
           batches: list) -> str:
    waits = []
    for t in batch:
        if t in done:
            continue
        peer = match.get(t)
        if peer is None:
            waits.append(f"{t} has no matching {'receive' if t.is_send else 'send'} posted as "
                         f"{t.form}")
            continue
        blocker = batches[peer.stage][position[peer.stage]][0] \
            if position[peer.stage] < len(batches[peer.stage]) else None
        waits.append(f"{t} waits for stage {peer.stage}'s {peer.action}, behind its exchange at "
                     f"action {blocker.position} ({blocker.action})" if blocker is not None
                     else f"{t} waits for stage {peer.stage}'s {peer.action}")
    return "; ".join(waits)


def check(actions: list[list[S.Action]], form: Callable[[list[S.Action]], str] = batched,
          shape: str = "loop") -> ReplayResult:
    """Replay under NCCL's rules; raise ScheduleError on a deadlock or a mismatched transfer."""
    result = replay(actions, form, shape)
    if result.other_form:
        a, b = result.other_form[0]
        raise S.ScheduleError(f"{len(result.other_form)} of {result.transfers // 2} transfers "
                              f"are posted in another form than their match, first {a} and {b}: "
                              f"NCCL runs the two forms on different communicators")
    if result.mismatched:
        send, recv = result.mismatched[0]
        raise S.ScheduleError(f"{len(result.mismatched)} mismatched transfers under NCCL's "
                              f"posting-order matching, first {send} met by {recv}")
    if result.deadlock:
        raise S.ScheduleError(f"deadlock under NCCL's rules (a send waits for its receive, a "
                              f"stage's exchanges run in order): {result.deadlock}")
    return result


def check_schedule(schedule: str, stages: int, microbatches: int, chunks: int = 1,
                   batches: int = 3) -> None:
    """Every rule for one run's shape, without processes: the lists of `batches` batches (the
    warm-up, the steady state and the drain of any segment) by schedules.validate, and they and
    the evaluation's forward-only lists under NCCL's rules. Raises ScheduleError."""
    actions = S.build_schedule(schedule, stages, microbatches, batches, 0, chunks)
    S.validate(actions, schedule, microbatches)
    shape = S.REGISTRY[schedule].shape
    check(actions, shape=shape)
    if shape == "loop":  # the evaluation's order (the executor runs loop placements only)
        check([list(S.forward_only_actions(stages, microbatches, s, chunks))
               for s in range(stages)])
