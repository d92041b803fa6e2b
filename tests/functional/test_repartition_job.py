"""--pipeline-repartition-interval in a launched job: the stages measure their layers, a bad split
moves at the first interval (one log line per decision), and a rank that dies during a migration
ends the job naming it, with the last checkpoint intact."""
import os
import re
import subprocess
import sys

from megatron_2bw.checkpoint.reshard import read_full_state
from tests.distributed_helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
JOB = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
       "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size",
       "64", "--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "3,1",
       "--log-interval", "2", "--train-iters", "6", "--eval-iters", "0",
       "--pipeline-repartition-interval", "3", "--distributed-timeout-minutes", "0.2"]


def _run(script, extra, env=None):
    command = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), script, *JOB,
               *extra]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, **(env or {})})


def test_a_bad_split_moves_at_the_first_interval_and_resumes_where_it_moved(tmp_path):
    # equal layers, measured alike on any machine (even_layer_times.py): 3,1 must move
    save = ["--save", str(tmp_path), "--save-interval", "4", "--train-iters", "8"]
    job = _run("tests/functional/even_layer_times.py", [*save, "--exit-interval", "4"])
    assert job.returncode == 0, job.stdout + job.stderr
    decisions = re.findall(r"repartition at iteration (\d+): split (\S+) recompute \S+ -> split "
                           r"(\S+) recompute \S+, predicted gain ([\d.]+)%, (moved in [\d.]+ s|kept)",
                           job.stdout)
    assert len(decisions) == 1, job.stdout  # iteration 4 is the end: no decision there
    iteration, old, new, gain, outcome = decisions[0]
    assert (iteration, old) == ("3", "3,1") and new in ("2,2", "1,3") and float(gain) >= 5
    assert outcome.startswith("moved in")
    # the same command line continues at the moved split, not the typed 3,1
    again = _run("tests/functional/even_layer_times.py", [*save, "--load", str(tmp_path)])
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"continuing with the checkpoint's --pipeline-layer-split {new}" in again.stdout
    assert "loaded checkpoint" in again.stdout and re.search(r"iteration\s+8/\s*8", again.stdout)


def test_a_rank_dying_in_a_migration_ends_the_job_and_keeps_the_checkpoint(tmp_path):
    job = _run("tests/functional/die_in_repartition.py",
               ["--save", str(tmp_path), "--save-interval", "3"], {"DIE_RANK": "0"})
    output = job.stdout + job.stderr
    assert job.returncode != 0, output  # 0: no migration ran (its layers measure alike: 3,1 moves)
    # the survivor names it (unless the launcher stopped it first, which names it too)
    assert re.search(r"rank 0 stopped during the migration|rank\s+:\s+0 \(local_rank", output), \
        output
    state = read_full_state(str(tmp_path), show_progress=False)
    assert state.iteration == 3 and state.config.parallel.layer_split == [3, 1]
