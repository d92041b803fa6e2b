"""NCCL's rule for collectives in a whole job: every rank of each process group issues the same
collectives in the same order (same op, dtype, element count, reduction, root).

A 2BW job at t=2 x p=2 x d=2 (8 gloo ranks) with every feature that adds collectives: ZeRO-1
(--use-distributed-optimizer, its reduce-scatters and background all-gathers),
--overlap-grad-reduce, --sequence-parallel, evaluation, a checkpoint saved and then loaded by a
second job, and a live repartition (--pipeline-repartition-interval, from the bad split 3,1 whose
layers measure alike, so it moves). Every collective of every rank is recorded
(tests/collective_order.py) and compared group by group."""
import re
from pathlib import Path


from megatron_2bw.arguments import parse_config
from megatron_2bw.distributed import comm
from megatron_2bw.pipeline import layer_times
from megatron_2bw.training import loop
from tests.collective_order import check_same_order, load_calls, record_collectives, save_calls
from tests.distributed_helpers import run_ranks
from tests.functional.even_layer_times import even_collect

WORLD = 8
JOB = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
       "--pipeline-schedule", "2bw", "--num-layers", "4", "--pipeline-layer-split", "3,1",
       "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "64",
       "--use-distributed-optimizer", "--overlap-grad-reduce", "--sequence-parallel",
       "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
       "--pipeline-repartition-interval", "2", "--save-interval", "4",
       "--lr-decay-iters", "6", "--distributed-timeout-minutes", "1"]


def recorded_pretrain(rank, world, flags, log_dir):
    """pretrain(flags) on this forked rank, its collectives written to log_dir/<rank>.json (also
    when the job fails: a divergence explains a failure)."""
    layer_times.LayerTimes.collect = even_collect  # the forked rank's own module
    with record_collectives() as calls:
        try:
            loop.pretrain(parse_config(flags)[0])
        finally:
            save_calls(calls, Path(log_dir, f"{rank}.json"))


def run_and_check(flags, log_dir, capfd) -> tuple[dict, set, str]:
    """Run the job, check every group's order (before the job's own outcome: a divergence is
    the likeliest cause of a failure); the collective counts by group, the collectives rank 0
    issued and the job's output."""
    Path(log_dir).mkdir()
    failure = None
    try:
        run_ranks(WORLD, recorded_pretrain, flags, str(log_dir), timeout=400)
    except RuntimeError as error:
        failure = error
    output = capfd.readouterr().out
    logs = {rank: load_calls(Path(log_dir, f"{rank}.json")) for rank in range(WORLD)
            if Path(log_dir, f"{rank}.json").exists()}
    counts = check_same_order(logs)
    if failure is not None:
        raise failure
    assert len(logs) == WORLD
    return counts, {call.what.split("(")[0] for call in logs[0]}, output


def test_every_group_issues_the_same_collectives_in_order(tmp_path, capfd):
    save = ["--save", str(tmp_path / "checkpoint")]
    counts, issued, output = run_and_check([*JOB, *save, "--train-iters", "4"],
                                           tmp_path / "first", capfd)
    # what the run was meant to exercise did happen
    assert re.search(r"repartition at iteration 2: split 3,1 .* -> split (2,2|1,3) .*moved in",
                     output), output
    assert "validation at iteration 2" in output and "saved checkpoint" in output, output
    # collectives on the world and on every tensor (4), data (4) and embedding (4) group
    assert len(counts) >= 1 + 4 + 4 + 4 and min(counts.values()) > 0, counts
    # sequence parallelism's gathers and reduce-scatters, ZeRO-1's reduce-scatters and gathers,
    # the repartition's exchange of layer times and state, the checkpoint's barrier
    assert {"all_reduce", "all_gather", comm.reduce_scatter_tensor.__name__,
            comm.all_gather_into_tensor.__name__, "all_gather_object", "broadcast_object_list",
            "barrier", "new_group"} <= issued, issued

    _, _, output = run_and_check([*JOB, *save, "--load", str(tmp_path / "checkpoint"),
                                  "--train-iters", "6"], tmp_path / "second", capfd)
    assert "loaded checkpoint" in output and "validation at iteration 6" in output, output


def test_muon_whole_matrix_gathers_keep_the_order(tmp_path, capfd):
    """--optimizer muon adds, inside every step, the gather of the ZeRO-1 shard's updates over
    the data-parallel group and one gather per matrix over the tensor-parallel group; with the
    repartition moving layers (and their momentum buffers) between the stages."""
    counts, issued, output = run_and_check([*JOB, "--optimizer", "muon", "--train-iters", "4"],
                                           tmp_path / "muon", capfd)
    assert re.search(r"repartition at iteration 2: split 3,1 .* -> split (2,2|1,3) .*moved in",
                     output), output
    assert re.search(r"iteration\s+4/\s*4 \|", output), output
    assert {"all_gather", comm.all_gather_into_tensor.__name__} <= issued, issued
