"""The launch scripts under examples/ start real multi-process training on this machine: two
torchrun "nodes" on 127.0.0.1, the Slurm batch scripts with stand-in srun/scontrol
(tests/functional/shims), including the time-limit signal -> checkpoint -> requeue -> resume cycle,
and the DeepSpeed launcher with a local hostfile."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_2bw.checkpoint.save_load import saved_config
from tests.distributed_helpers import free_port

REPO = Path(__file__).resolve().parents[2]
SHIMS = Path(__file__).resolve().parent / "shims"
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*lm loss: (\S+)")

# A tiny GPT on mock data, set through the scripts' variables (not flags) to exercise them.
TINY_GPT = {
    "NUM_LAYERS": "2", "HIDDEN_SIZE": "32", "NUM_ATTENTION_HEADS": "4", "SEQ_LENGTH": "16",
    "MICRO_BATCH_SIZE": "2", "GLOBAL_BATCH_SIZE": "4", "TRAIN_ITERS": "4", "LR": "1e-3",
    "MIN_LR": "1e-4", "LR_WARMUP_ITERS": "1", "LOG_INTERVAL": "1", "VOCAB_SIZE": "128",
    "PRECISION": "fp32", "DATA_PATH": "", "GPUS_PER_NODE": "1", "RDZV_JOIN_TIMEOUT": "300",
    "DIST_TIMEOUT_MINUTES": "2", "TP": "1",
}



def _environment(**overrides: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **TINY_GPT)
    env.update(overrides)
    return env


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as output:  # a file, not a pipe: nothing blocks on a full pipe
        return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)


def _finish(process: subprocess.Popen, log: Path, timeout: float) -> str:
    """Wait for the process; on timeout kill its whole session (torchrun and workers) and fail."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise AssertionError(f"timed out after {timeout} s:\n{log.read_text()[-4000:]}") from None
    return log.read_text()


def _iterations(output: str) -> list[tuple[int, int, float]]:
    return [(int(i), int(n), float(loss)) for i, n, loss in ITERATION_LINE.findall(output)]


def test_multi_node_script_as_two_nodes_on_localhost(tmp_path):
    env = _environment(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       PP="1")  # 2 nodes x 1 process: data parallel 2 across the "nodes"
    script = str(REPO / "examples" / "pretrain_gpt_multi_node.sh")
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    nodes = [_start(["bash", script], {**env, "NODE_RANK": str(rank)}, logs[rank])
             for rank in (0, 1)]
    try:
        outputs = [_finish(node, log, timeout=600) for node, log in zip(nodes, logs)]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-4000:]
    iterations = _iterations("".join(outputs))
    assert [i for i, _, _ in iterations] == [1, 2, 3, 4], "".join(outputs)[-4000:]
    assert all(total == 4 and loss > 0 for _, total, loss in iterations)


def _slurm_environment(tmp_path: Path, **overrides: str) -> dict[str, str]:
    shim_bin = tmp_path / "bin"
    if not shim_bin.exists():  # copies, so the execute bit does not depend on the checkout
        shim_bin.mkdir()
        for shim in ("srun", "scontrol"):
            shutil.copy(SHIMS / shim, shim_bin / shim)
            (shim_bin / shim).chmod(0o755)
    env = _environment(
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="gpt-test", SLURM_JOB_NUM_NODES="2",
        SLURM_NNODES="2", SLURM_JOB_NODELIST="127.0.0.1,127.0.0.2", SLURM_SUBMIT_DIR=str(REPO),
        SLURM_CPUS_PER_TASK="1", SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        CHECKPOINT_DIR=str(tmp_path / "checkpoints"), MASTER_PORT=str(free_port()),
        SAVE_GRACE_SECONDS="30", PP="2")  # one pipeline stage per "node", 2BW schedule
    env["PATH"] = f"{shim_bin}{os.pathsep}{env['PATH']}"
    env.update(overrides)
    return env


def _wait_for(predicate, log: Path, process: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        output = log.read_text()
        if predicate(output):
            return output
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} too early:\n{output[-4000:]}")
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError(f"condition not met after {timeout} s:\n{log.read_text()[-4000:]}")


def test_slurm_batch_script_saves_on_time_limit_requeues_and_resumes(tmp_path):
    sbatch = str(REPO / "examples" / "slurm" / "pretrain_gpt.sbatch")
    scontrol_log = tmp_path / "scontrol.log"

    # First run: a long job that gets Slurm's time-limit warning (USR1 to the batch shell).
    log = tmp_path / "first.log"
    job = _start(["bash", sbatch], _slurm_environment(tmp_path, TRAIN_ITERS="100000"), log)
    _wait_for(lambda out: len(_iterations(out)) >= 2, log, job, timeout=600)
    os.kill(job.pid, signal.SIGUSR1)
    output = _finish(job, log, timeout=600)
    assert job.returncode == 0, output[-4000:]
    assert "time limit near" in output
    assert scontrol_log.read_text() == "requeue 4242\n"
    checkpoints = tmp_path / "checkpoints"
    saved = int((checkpoints / "latest_checkpointed_iteration.txt").read_text().strip())
    trained = max(i for i, _, _ in _iterations(output))
    assert 2 <= saved <= trained + 1, output[-4000:]

    # The requeued job: same job id and checkpoint dir; it resumes after the saved iteration. It
    # stops two iterations later, keeping the checkpoint's learning-rate schedule (--train-iters,
    # which the decay length follows, changed).
    log = tmp_path / "requeued.log"
    env = _slurm_environment(tmp_path, TRAIN_ITERS=str(saved + 2), SLURM_RESTART_COUNT="1")
    job = _start(["bash", sbatch, "--use-checkpoint-opt_param-scheduler"], env, log)
    output = _finish(job, log, timeout=600)
    assert job.returncode == 0, output[-4000:]
    assert [i for i, _, _ in _iterations(output)] == [saved + 1, saved + 2], output[-4000:]
    assert scontrol_log.read_text() == "requeue 4242\n"  # finished: not requeued again


def test_bert_batch_script_runs_the_bert_node_launcher(tmp_path):
    env = _slurm_environment(tmp_path, SLURM_JOB_NAME="bert-test")
    log = tmp_path / "bert.log"
    job = _start(["bash", str(REPO / "examples" / "slurm" / "pretrain_bert.sbatch")], env, log)
    output = _finish(job, log, timeout=600)
    assert job.returncode == 0, output[-4000:]
    assert "pretrain_bert_multi_node.sh" in output and "sop loss" in output
    assert [i for i, _, _ in _iterations(output)] == [1, 2, 3, 4], output[-4000:]
    marker = tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert marker.read_text().strip() == "4"
    assert not (tmp_path / "scontrol.log").exists()  # a finished job is not requeued


def test_deepspeed_launcher_script_with_a_local_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = _environment(HOSTFILE=str(hostfile), LAUNCHER_ARGS="--no_ssh_check",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       TP="2", PP="1")  # the launcher's 2 processes: the 2 tensor-parallel halves
    log = tmp_path / "deepspeed.log"
    job = _start(["bash", str(REPO / "examples" / "pretrain_gpt_deepspeed_launcher.sh")], env, log)
    output = _finish(job, log, timeout=600)
    assert job.returncode == 0, output[-4000:]
    assert "--local_rank=1" in output  # the launcher passed it, and pretrain_gpt.py accepted it
    assert ", schedule flush," in output  # the scripts leave 2BW to PP > 1, as pretrain_gpt.py does
    assert [i for i, _, _ in _iterations(output)] == [1, 2, 3, 4], output[-4000:]


def test_deepspeed_launcher_script_names_a_missing_hostfile(tmp_path):
    env = _environment(HOSTFILE=str(tmp_path / "nope"))
    result = subprocess.run(["bash", str(REPO / "examples" / "pretrain_gpt_deepspeed_launcher.sh")],
                            env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"HOSTFILE={tmp_path / 'nope'} does not exist" in result.stderr


def test_llama_script_trains_a_llama_layout_through_a_2bw_pipeline(tmp_path):
    env = _environment(GPUS_PER_NODE="2", PP="2", FFN_HIDDEN_SIZE="64", NUM_QUERY_GROUPS="2",
                       CHECKPOINT_DIR=str(tmp_path / "checkpoint"), SAVE_INTERVAL="4")
    log = tmp_path / "llama.log"
    job = _start(["bash", str(REPO / "examples" / "pretrain_llama_single_node.sh")], env, log)
    output = _finish(job, log, timeout=120)
    assert job.returncode == 0, output[-4000:]
    assert ", schedule 2bw," in output
    assert [i for i, _, _ in _iterations(output)] == [1, 2, 3, 4], output[-4000:]
    model = saved_config(str(tmp_path / "checkpoint")).model
    assert (model.normalization, model.swiglu, model.position_embedding_type,
            model.num_query_groups, model.untie_embeddings_and_output_weights,
            model.add_bias_linear) == ("RMSNorm", True, "rope", 2, True, False)
