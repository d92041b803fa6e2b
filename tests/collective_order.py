"""Records every collective a rank issues, per process group, and checks NCCL's rule that all ranks
of a group issue the same collectives in the same order.

Gloo forgives much that NCCL does not: ranks of a group that issue different collectives, or the
same ones in another order, or with another element count, dtype, reduction or root, hang or
exchange garbage on NCCL. `record_collectives()` wraps every collective of torch.distributed
(and `new_group`, which every rank of the world must call alike) while it is active, in this
process: the wrapped function is replaced wherever a module holds it, so aliases bound at import
time (megatron_2bw.distributed.comm) are recorded too. A collective made of others
(all_gather_object is two all_gathers) is recorded once, as called. `check_same_order(logs)` takes
every rank's record and fails at the first divergence, naming the group, the rank and the
position.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import sys
import threading
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# collective -> (the tensor whose dtype and element count must match on every rank, the
# arguments that must match, a list whose length must match)
SIGNATURES = {
    "all_reduce": ("tensor", ("op",), None),
    "all_reduce_coalesced": (None, ("op",), "tensors"),
    "broadcast": ("tensor", ("src",), None),
    "reduce": ("tensor", ("dst", "op"), None),
    "all_gather": ("tensor", (), "tensor_list"),
    "all_gather_into_tensor": ("input_tensor", (), None),
    "all_gather_single": ("input_tensor", (), None),
    "_all_gather_base": ("input_tensor", (), None),
    "reduce_scatter": ("output", ("op",), "input_list"),
    "reduce_scatter_tensor": ("input", ("op",), None),
    "reduce_scatter_single": ("input", ("op",), None),
    "_reduce_scatter_base": ("input", ("op",), None),
    "gather": ("tensor", ("dst",), None),
    "scatter": ("tensor", ("src",), None),
    "all_to_all": (None, (), "input_tensor_list"),
    "all_to_all_single": (None, (), None),
    "barrier": (None, (), None),
    "monitored_barrier": (None, (), None),
    "all_gather_object": (None, (), None),
    "broadcast_object_list": (None, ("src",), "object_list"),
    "gather_object": (None, ("dst",), None),
    "scatter_object_list": (None, ("src",), None),
    "new_group": (None, ("ranks",), None),
}
_ROOTS = {"src": "group_src", "dst": "group_dst"}  # a root given by its rank in the group


@dataclass(frozen=True)
class Call:
    """One collective as a rank issued it: `what` must be equal on every rank of the group."""
    group: str  # the group's name and its ranks in the world
    what: str  # e.g. "all_reduce(float32[4096], op=SUM)"
    site: str  # where the project called it (file:line), for the message only

    def __str__(self) -> str:
        return f"{self.what} at {self.site}"


def _group_key(group) -> str:
    group = group if group is not None else dist.group.WORLD
    return f"{group.group_name} (world ranks {dist.get_process_group_ranks(group)})"


def _value(value) -> str:
    if isinstance(value, (dist.ReduceOp, dist.ReduceOp.RedOpType)):  # by name, not by address
        return next(name for name, member in dist.ReduceOp.RedOpType.__members__.items()
                    if value == member)
    return repr(value)


def _describe(name: str, bound: inspect.BoundArguments) -> tuple[str, str]:
    """(group, what) of a call of the collective `name`."""
    tensor_arg, matching, list_arg = SIGNATURES[name]
    arguments = bound.arguments
    if name == "new_group":
        group = None
        members = arguments.get("ranks")
        parts = [f"ranks={sorted(members) if members is not None else 'all'}"]
    else:
        group = arguments.get("group")
        parts = []
        tensor = arguments.get(tensor_arg) if tensor_arg else None
        if isinstance(tensor, torch.Tensor):
            parts.append(f"{str(tensor.dtype).removeprefix('torch.')}[{tensor.numel()}]")
        if list_arg is not None and arguments.get(list_arg) is not None:
            parts.append(f"{list_arg} of {len(arguments[list_arg])}")
        for argument in matching:
            value = arguments.get(argument)
            if value is None and argument in _ROOTS and arguments.get(_ROOTS[argument]) is not None:
                value = dist.get_global_rank(group if group is not None else dist.group.WORLD,
                                             arguments[_ROOTS[argument]])
            parts.append(f"{argument}={_value(value)}")
    return _group_key(group), f"{name}({', '.join(parts)})"


def _call_site() -> str:
    """The innermost frame outside torch, this file and the group-of-one helpers
    (distributed/comm.py): the code that issued the collective."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__ and \
                not frame.filename.endswith("distributed/comm.py"):
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def record_collectives():
    """While active, every collective this process issues is appended to the yielded list of
    Calls (in issue order). Nested collectives (those a collective makes of others) are left
    out."""
    calls: list[Call] = []
    depth = threading.local()
    originals = {name: getattr(dist, name) for name in SIGNATURES if hasattr(dist, name)}
    wrapped = {}
    for name, original in originals.items():
        signature = inspect.signature(original)

        def wrapper(*args, _name=name, _original=original, _signature=signature, **kwargs):
            outer = getattr(depth, "level", 0) == 0
            if outer:
                bound = _signature.bind(*args, **kwargs)
                bound.apply_defaults()
                group, what = _describe(_name, bound)
                calls.append(Call(group, what, _call_site()))
            depth.level = getattr(depth, "level", 0) + 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth.level -= 1
        wrapper.__wrapped__ = original
        wrapped[id(original)] = wrapper
    # replace the functions wherever a loaded module holds them (including the aliases)
    replaced = []
    for module in list(sys.modules.values()):
        if module is None or not module.__name__.startswith(("torch.distributed", "megatron_2bw",
                                                                 "tests", "__main__")):
            continue
        for attribute, value in list(vars(module).items()):
            if id(value) in wrapped and value is wrapped[id(value)].__wrapped__:
                setattr(module, attribute, wrapped[id(value)])
                replaced.append((module, attribute, value))
    try:
        yield calls
    finally:
        for module, attribute, value in replaced:
            setattr(module, attribute, value)


def save_calls(calls: list[Call], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(call) for call in calls]))


def load_calls(path: str | Path) -> list[Call]:
    return [Call(**call) for call in json.loads(Path(path).read_text())]


class CollectiveOrderError(AssertionError):
    pass


def check_same_order(logs: dict[int, list[Call]]) -> dict[str, int]:
    """Every group's collectives, in each member rank's issue order, must be alike on all its
    members (those in `logs`). Fails at the first divergence, naming the group, the rank and the
    position; returns how many collectives each group saw."""
    by_group: dict[str, dict[int, list[Call]]] = {}
    for rank, calls in sorted(logs.items()):
        for call in calls:
            by_group.setdefault(call.group, {}).setdefault(rank, []).append(call)
    counts = {}
    for group, sequences in sorted(by_group.items()):
        members = json.loads(group.split("world ranks ", 1)[1].rstrip(")"))
        for rank in members:  # a member that issued nothing on the group
            if rank in logs:
                sequences.setdefault(rank, [])
        reference_rank = min(sequences)
        reference = sequences[reference_rank]
        for rank, calls in sorted(sequences.items()):
            for position in range(max(len(reference), len(calls))):
                mine = calls[position] if position < len(calls) else None
                theirs = reference[position] if position < len(reference) else None
                if mine is None or theirs is None or mine.what != theirs.what:
                    raise CollectiveOrderError(
                        f"group {group}: rank {rank}'s collective #{position} is "
                        f"{mine or 'missing (it issued ' + str(len(calls)) + ')'}, "
                        f"rank {reference_rank}'s is "
                        f"{theirs or 'missing (it issued ' + str(len(reference)) + ')'}")
        counts[group] = len(reference)
    return counts
