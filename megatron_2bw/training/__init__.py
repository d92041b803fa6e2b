"""Pretraining: the loop (loop.py) over a rank's stage (stage.py), run in segments between drains
(segments.py), with start-up checks (startup.py), progress logging (progress.py), clean stops
(exit_request.py), memory housekeeping (housekeeping.py) and failure reports (failures.py)."""
from megatron_2bw.training.failures import run_and_report
from megatron_2bw.training.loop import main, pretrain

__all__ = ["main", "pretrain", "run_and_report"]
