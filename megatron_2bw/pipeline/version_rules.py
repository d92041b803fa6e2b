"""Which weight version each batch reads on each stage, and how many versions a stage holds.

Batch b reads version max(0, b - delay) where the delay is the schedule's: 1 under 2BW, p-1-s under
PipeDream on stage s, p-1 under PipeDream with vertical sync, 0 for the vanilla schedules
(PipeMare: its backwards; its forwards follow pipemare.forward_version).
"""
from __future__ import annotations

from dataclasses import dataclass


def update_delay(schedule: str, stage: int = 0, stages: int = 1) -> int:
    """How many updates behind the newest weights a stage's batches run: batch b reads version
    max(0, b - delay) (PipeMare: its backwards; its forwards, pipemare.forward_version)."""
    if schedule == "2bw":
        return 1
    if schedule == "pipedream":
        return stages - 1 - stage
    if schedule == "pipedream-vs":
        return stages - 1
    return 0


def version_for_batch(schedule: str, batch: int, stage: int = 0, stages: int = 1) -> int:
    """The weight version batch `batch` reads on `stage` of `stages` (forward and backward alike;
    PipeMare: the backward)."""
    return max(batch - update_delay(schedule, stage, stages), 0)


def live_versions(schedule: str, stages: int = 1, stage: int = 0) -> int:
    """The most weight versions `stage` holds at once (the validator checks it): the delay plus
    one, from the version its oldest batch in flight reads to the newest: 1 for the flushed
    schedules, 2 for 2BW, p - s for PipeDream, p on every stage under vertical sync."""
    return update_delay(schedule, stage, stages) + 1


@dataclass(frozen=True)
class VersionRule:
    """The weight-version rule of one stage: which version each batch reads and how many
    versions the stage holds at most (what WeightVersions allocates)."""
    schedule: str
    stages: int = 1
    stage: int = 0

    def version_for_batch(self, batch: int) -> int:
        return version_for_batch(self.schedule, batch, self.stage, self.stages)

    @property
    def live_versions(self) -> int:
        return live_versions(self.schedule, self.stages, self.stage)

    @property
    def global_step_decisions(self) -> bool:
        """Whether a step waits for every stage's gradient norm (clipping, overflow): all but
        plain PipeDream and PipeMare, whose later stages need a new version before the first
        stage's gradient of that update exists."""
        return self.schedule not in ("pipedream", "pipemare") or self.stages == 1
