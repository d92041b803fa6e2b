"""--auto-parallel's start-up planning on 2 gloo ranks: detected hardware, a measured profile
(rank 0 profiles in as many forked copies as the job keeps cores busy) and one plan for all."""
import os

import pytest

from megatron_2bw.arguments import explicit_fields, parse_config
from megatron_2bw.config import ConfigError
from megatron_2bw.config_checks import validate_for_world
from megatron_2bw.planner.auto import describe_plan, plan_job
from tests.distributed_helpers import run_ranks

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "64",
        "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
        "--auto-parallel", "--planner-hardware", "local"]


def _plan(rank, world_size, argv):
    config, args = parse_config(argv, "gpt", require_data=False)
    planned, plan = plan_job(config, world_size, rank, explicit_fields(args))
    par = planned.parallel
    return (par.tensor_parallel, par.pipeline_parallel, planned.training.micro_batch_size,
            par.pipeline_schedule, describe_plan(plan))


def test_every_rank_applies_the_same_plan(tmp_path):
    argv = ARGV + ["--planner-profile-cache", str(tmp_path)]
    plans = run_ranks(2, _plan, argv, timeout=300)
    assert plans[0] == plans[1]
    t, p, micro, schedule, described = plans[0]
    assert 2 % (t * p) == 0 and 8 % micro == 0 and schedule in ("2bw", "flush", "gpipe")
    assert "predicted" in described
    # rank 0 profiled on this machine and cached it; the name says how many copies ran at once
    [cache] = tmp_path.glob("*.json")
    copies = min(2, len(os.sched_getaffinity(0)))
    assert cache.name.endswith(f"__x{copies}.json" if copies > 1 else "float32.json")


def test_a_typed_dimension_stays_pinned(tmp_path):
    argv = ARGV + ["--planner-profile-cache", str(tmp_path), "--tensor-model-parallel-size", "2"]
    plans = run_ranks(2, _plan, argv, timeout=300)
    assert plans[0][0] == 2 and plans[0][1] == 1  # t typed: 2; p follows from t x p x d = 2


def _plan_sequence_parallel(rank, world_size, argv):
    config, args = parse_config(argv, "gpt", require_data=False)
    planned, plan = plan_job(config, world_size, rank, explicit_fields(args))
    validate_for_world(planned, world_size)  # what the runtime checks next
    return planned.model.sequence_parallel, planned.parallel.tensor_parallel, describe_plan(plan)


def test_sequence_parallel_is_profiled_and_planned_as_given(tmp_path):
    """--auto-parallel with --sequence-parallel: the t = 2 shard is profiled on its half of the
    sequence (the cache says so) and the plan keeps the flag."""
    argv = ARGV + ["--planner-profile-cache", str(tmp_path), "--sequence-parallel"]
    plans = run_ranks(2, _plan_sequence_parallel, argv, timeout=300)
    assert plans[0] == plans[1] and plans[0][0] and "predicted" in plans[0][2]
    [cache] = tmp_path.glob("*.json")
    assert "-sp-" in cache.name


def test_nothing_that_fits_is_one_line_naming_the_smallest_need():
    """A 48-layer, 8192-wide GPT on one A100: ConfigError (one line, exit 2), no traceback."""
    argv = ["--num-layers", "48", "--hidden-size", "8192", "--num-attention-heads", "64",
            "--seq-length", "2048", "--vocab-size", "128", "--global-batch-size", "8",
            "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--auto-parallel",
            "--planner-hardware", "dgx-a100"]
    config, args = parse_config(argv, "gpt", require_data=False)
    with pytest.raises(ConfigError, match=r"^--auto-parallel: no configuration fits in memory on "
                                          r"dgx-a100; the smallest \(t=1 p=1 d=1 .*\) needs "
                                          r"[0-9.]+ GiB per device, the limit is 74.10 GiB: use "
                                          r"more devices"):
        plan_job(config, 1, 0, explicit_fields(args))


def _refusal(rank, world_size, argv):
    config, args = parse_config(argv, "gpt", require_data=False)
    try:
        plan_job(config, world_size, rank, explicit_fields(args))
    except ConfigError as error:
        return str(error)
    return None


def test_a_pinned_layout_the_world_cannot_hold_stops_every_rank_with_one_line():
    """Rank 0 searches; the other rank learns of the refusal from it instead of waiting."""
    argv = ARGV[:-1] + ["dgx-a100", "--tensor-model-parallel-size", "2",
                        "--pipeline-model-parallel-size", "2"]
    refusals = run_ranks(2, _refusal, argv, timeout=300)
    assert refusals[0] == refusals[1]
    assert refusals[0].startswith("--auto-parallel: no valid parallel configuration for world "
                                  "size 2"), refusals[0]
