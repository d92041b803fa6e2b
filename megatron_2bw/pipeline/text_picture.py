"""A schedule as a rank-by-time text grid (tools/visualize_schedule.py --text, tests, docs)."""
from __future__ import annotations

from megatron_2bw.pipeline.actions import BACKWARD_WEIGHT, COMPUTE_KINDS, LETTERS, Action
from megatron_2bw.pipeline.replay import timeline


def render(actions: list[list[Action]], width: int = 200, shape: str = "loop") -> str:
    """Rank-by-time text grid (forward 1 slot, backward 2 slots): `F3` / `B3` then the version."""
    timed = timeline(actions, shape=shape)
    end = max((t.end for row in timed for t in row), default=0.0)
    columns = min(int(end), width)
    chunked = any(t.action.chunk for row in timed for t in row)

    def label(a: Action) -> str:
        chunk = f".{a.chunk}" if chunked else ""
        return f"{LETTERS[a.kind]}{a.microbatch}{chunk}v{a.version}"
    cell = max([5, *(len(label(t.action)) + 1 for row in timed for t in row
                     if t.action.kind in COMPUTE_KINDS)])  # a space after every label
    lines = []
    for s, row in enumerate(timed):
        grid = ["." * cell] * columns
        for t in row:
            if t.action.kind not in COMPUTE_KINDS or int(t.start) >= columns:
                continue
            for c in range(int(t.start), min(int(t.end), columns)):
                grid[c] = label(t.action).ljust(cell) if c == int(t.start) else "-" * cell
        lines.append(f"stage {s} |" + "".join(grid))
    split = any(t.action.kind == BACKWARD_WEIGHT for row in timed for t in row)
    lines.append("F<k>v<w>: forward of microbatch k with weight version w; B: backward "
                 + ("input gradient, W: weight gradient (1 slot each); " if split else "(2 slots); ")
                 + ("<k>.<c>: chunk c; " if chunked else "") + "'.' idle")
    return "\n".join(lines)
