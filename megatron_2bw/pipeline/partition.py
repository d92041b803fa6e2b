"""Which layers each pipeline stage holds, and which of them recompute."""
from __future__ import annotations

from megatron_2bw.config import RecomputeConfig


def layer_ranges(num_layers: int, stages: int, split: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges per stage: `split` (layers per stage) when given, otherwise as even
    as possible with any remainder on the middle stages (the first and last also carry the
    embedding and the head)."""
    if split is None:
        base, extra = divmod(num_layers, stages)
        middle_first = sorted(range(stages), key=lambda s: (s in (0, stages - 1), s))
        split = [base + (1 if s in middle_first[:extra] else 0) for s in range(stages)]
    if len(split) != stages or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"--pipeline-layer-split {split} must give {stages} positive layer counts "
                         f"summing to {num_layers}")
    starts = [sum(split[:s]) for s in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, split)]


def stage_recompute(recompute: RecomputeConfig, stage: int) -> RecomputeConfig:
    """The recomputation one stage runs: under a per-stage plan (--recompute-num-layers-per-stage)
    its first plan[stage] layers recompute in full, one by one (Megatron's "block" method with that
    stage's count); otherwise the job-wide setting."""
    plan = recompute.num_layers_per_stage
    if plan is None:
        return recompute
    return block_recompute(plan[stage])


def block_recompute(layers: int) -> RecomputeConfig:
    """The first `layers` layers of a module recompute in full, one by one (none: no recompute)."""
    if layers == 0:
        return RecomputeConfig()
    return RecomputeConfig(granularity="full", method="block", num_layers=layers)


def chunk_recompute(recompute: RecomputeConfig, stage: int, chunk_layers: list[int]
                    ) -> list[RecomputeConfig]:
    """The recomputation of each model chunk of a pipeline rank (interleaved schedule): a per-stage
    plan's count runs over the rank's layers in chunk order (chunk 0's first, as its activations
    wait longest), otherwise every chunk runs the job-wide setting."""
    plan = recompute.num_layers_per_stage
    if plan is None:
        return [recompute] * len(chunk_layers)
    left, out = plan[stage], []
    for n in chunk_layers:
        out.append(block_recompute(min(left, n)))
        left -= min(left, n)
    return out
