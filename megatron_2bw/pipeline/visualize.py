"""Draw pipeline schedules as stage-by-time pictures (the paper's Figure 2, drawn from our own lists).

The boxes come from `schedules.build_schedule` replayed by `schedules.timeline`: the very action lists
the runtime executes, so the picture cannot drift from the code. Colour = weight version, solid =
forward, light hatched = backward (split: B light hatched, W light dotted), the number = microbatch
(".c" its model chunk where a rank holds several), a black tick = a step creating a version.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_2bw.pipeline import schedules as S

IDLE_COLOUR = "#eeeeee"


@dataclass(frozen=True)
class ScheduleShape:
    schedule: str
    stages: int
    microbatches: int
    batches: int
    chunks: int = 1  # interleaved and the V schedules: model chunks per rank

    def title(self) -> str:
        names = {"2bw": "PipeDream-2BW", "flush": "PipeDream-Flush (1F1B)", "gpipe": "GPipe",
                 "pipedream": "PipeDream (weight stashing, p - s versions on stage s)",
                 "pipedream-vs": "PipeDream with vertical sync (p versions per stage)",
                 "pipemare": "PipeMare (one version per stage: backwards read the newest)",
                 "zb-h1": "ZB-H1 (zero bubble: backward split into B and W)",
                 "interleaved": f"interleaved 1F1B (v = {self.chunks} chunks per stage)",
                 "zb-v": "ZB-V (zero bubble, two chunks per rank in a V)",
                 "dualpipev": "DualPipeV (two chunks per rank in a V; F&B pairs)"}
        return (f"{names[self.schedule]}: p = {self.stages} stages, m = {self.microbatches} "
                f"microbatches per batch, {self.batches} batches")


def timed_schedule(shape: ScheduleShape, forward_time: float = 1.0,
                   backward_time: float = 2.0) -> list[list[S.TimedAction]]:
    """The lists replayed with these durations per stage (a chunk takes 1/v of them; a split
    backward's B and W take half each)."""
    actions = S.build_schedule(shape.schedule, shape.stages, shape.microbatches, shape.batches,
                               0, shape.chunks)
    durations = {S.FORWARD: forward_time, S.BACKWARD: backward_time,
                 S.BACKWARD_INPUT: backward_time / 2, S.BACKWARD_WEIGHT: backward_time / 2}
    return S.timeline(actions, lambda stage, a: durations.get(a.kind, 0.0) / shape.chunks,
                      shape=S.REGISTRY[shape.schedule].shape)


def makespan(timed: list[list[S.TimedAction]]) -> float:
    return max((t.end for row in timed for t in row), default=0.0)


def bubble_fraction(timed: list[list[S.TimedAction]]) -> float:
    """Idle share of all stages' time from the first start to the last end (fill and drain count)."""
    busy = sum(t.end - t.start for row in timed for t in row if t.action.kind in S.COMPUTE_KINDS)
    total = makespan(timed) * len(timed)
    return 1.0 - busy / total if total else 0.0


def version_colour(version: int) -> str:
    import matplotlib
    palette = matplotlib.colormaps["tab10"].colors
    return matplotlib.colors.to_hex(palette[version % len(palette)])


def _lighter(colour: str, amount: float = 0.55) -> tuple:
    import matplotlib.colors as mcolors
    r, g, b = mcolors.to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def draw_timeline(ax, timed: list[list[S.TimedAction]], title: str, end: float | None = None) -> None:
    """One schedule on matplotlib axes: a row per stage (stage 0 on top), time to the right."""
    from matplotlib.patches import Rectangle
    end = makespan(timed) if end is None else end
    height = 0.8
    chunked = any(t.action.chunk for row in timed for t in row)
    for stage, row in enumerate(timed):
        y = stage - height / 2
        ax.add_patch(Rectangle((0, y), makespan(timed), height, facecolor=IDLE_COLOUR, edgecolor="none"))
        for t in row:
            a = t.action
            if a.kind in S.COMPUTE_KINDS:
                colour = version_colour(a.version)
                forward = a.kind == S.FORWARD
                hatch = None if forward else "..." if a.kind == S.BACKWARD_WEIGHT else "///"
                ax.add_patch(Rectangle((t.start, y), t.end - t.start, height,
                                       facecolor=colour if forward else _lighter(colour),
                                       edgecolor=colour if not forward else "white",
                                       hatch=hatch, linewidth=0.8))
                label = str(a.microbatch) + (f".{a.chunk}" if chunked else "")
                ax.text((t.start + t.end) / 2, stage, label, ha="center", va="center",
                        fontsize=7, color="white" if forward else "black",
                        fontweight="bold" if forward else "normal")
        steps: dict[float, list[int]] = {}  # a drained segment end steps several batches at once
        for t in row:
            if t.action.kind == S.STEP:
                steps.setdefault(t.start, []).append(t.action.version)
        for time, created in steps.items():
            ax.plot([time, time], [y - 0.05, y + height + 0.05], color="black", linewidth=2)
            ax.text(time, y - 0.07, ",".join(f"v{v}" for v in created), ha="center", va="bottom",
                    fontsize=6)
    ax.set_xlim(0, end)
    ax.set_ylim(len(timed) - 0.5, -0.7)  # stage 0 on top, room for the version labels
    ax.set_yticks(range(len(timed)), [f"stage {s}" for s in range(len(timed))])
    ax.set_title(f"{title}\nbubble: {bubble_fraction(timed):.0%} of stage time, "
                 f"makespan {makespan(timed):g} units", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _legend(fig, versions: list[int], split: bool = False) -> None:
    """Two rows (forward above backward), one column per version, then idle and step (and the
    weight-gradient pass W where a backward is split)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles = []
    for v in versions:
        colour = version_colour(v)
        handles += [Patch(facecolor=colour, label=f"forward, weight version v{v}"),
                    Patch(facecolor=_lighter(colour), edgecolor=colour, hatch="///",
                          label=f"backward, weight version v{v}")]
    if split:
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="...",
                             label="W: weight gradient (split backward)"))
    handles += [Patch(facecolor=IDLE_COLOUR, label="idle (bubble)"),
                Line2D([], [], color="black", linewidth=2, label="step creating version vN")]
    fig.legend(handles=handles, loc="lower center", ncol=len(versions) + 1, fontsize=8,
               frameon=False)


def plot_schedules(shapes: list[ScheduleShape], output: str, forward_time: float = 1.0,
                   backward_time: float = 2.0) -> None:
    """Draw one schedule, or several stacked on a shared time axis (bubbles compare directly)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
    timed = [timed_schedule(shape, forward_time, backward_time) for shape in shapes]
    end = max(makespan(t) for t in timed)
    row_inches = 0.45
    heights = [shape.stages * row_inches + 0.9 for shape in shapes]
    versions = sorted({a.action.version for rows in timed for row in rows for a in row
                       if a.action.kind in S.COMPUTE_KINDS})
    legend_inches = 0.5
    fig_height = sum(heights) + legend_inches
    fig = Figure(figsize=(max(10.0, 0.22 * end + 2), fig_height))
    axes = fig.subplots(len(shapes), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, shape, t in zip(axes[:, 0], shapes, timed):
        draw_timeline(ax, t, shape.title(), end)
        ax.set_xlabel(f"time in units (a forward takes {forward_time:g}, a backward {backward_time:g})")
    _legend(fig, versions, any(a.action.kind == S.BACKWARD_WEIGHT
                               for rows in timed for row in rows for a in row))
    fig.tight_layout(rect=(0, legend_inches / fig_height, 1, 1))
    fig.savefig(output, dpi=130)
