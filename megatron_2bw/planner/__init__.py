"""Hardware-aware planner: choose t, p, d, micro batch size, recomputation and pipeline schedule.

    hardware.py  HardwareSpec from YAML (shipped: p3.16xlarge, dgx-a100, dgx-h100, one-GPU H100
                 and H200) or detected
    profile.py   per-layer/embedding/head times and activation bytes (ComputeCosts), from
                 analytic_profile.py (hardware not at hand) or measured_profile.py (measured here)
    memory.py    estimate_stage_memory: bytes per rank of a stage (also logged by the runtime)
    cost.py      durations of every schedule action; the PipeDream-2BW closed form
    simulator.py replays pipeline/schedules.py's action lists with those durations
    search.py    ranks every configuration; best_plan / apply_plan for callers
"""
from megatron_2bw.planner.hardware import HardwareSpec, detect_hardware, load_hardware
from megatron_2bw.planner.memory import StageMemory, estimate_stage_memory
from megatron_2bw.planner.search import Plan, SearchSpace, apply_plan, best_plan, rank_plans

__all__ = ["HardwareSpec", "Plan", "SearchSpace", "StageMemory", "apply_plan", "best_plan",
           "detect_hardware", "estimate_stage_memory", "load_hardware", "rank_plans"]
