"""Time to quality on real processes: Flush and 2BW under torchrun (p = 2, m = 2) on the quickstart
corpus, validation loss against measured training time.

    python benchmarks/time_to_quality.py    # docs/time_to_quality.json, docs/images/time_to_quality.png
    python benchmarks/time_to_quality.py --smoke --json /tmp/t.json --plot /tmp/t.png   # path only

Each recipe is a real job: `torchrun --standalone --nproc-per-node 2 pretrain_gpt.py` with the
quickstart's model (4 layers, hidden 128, 4 heads, sequence 128), global batch 32 in m = 2
microbatches of 16, p = 2, cosine decay to lr/10, weight decay 0.1, clipping at 1.0, evaluated on
the held-out plays every --eval-interval iterations. The recipes (schedule, correction, optimizer,
peak rate, warm-up) are each rule's best grid point in the convergence study's JSON
(benchmarks/convergence.py, --study): Flush's best, and the best of the 2BW rules (any correction,
any optimizer the study ran). They are taken from the study, not tuned here.

Training time is the log's: "time-per-iter-ms" of every log interval (the log interval is the
evaluation interval, and evaluation is excluded from it) summed, so the time at an evaluation is
the training time before it. The result: Flush's final validation loss (the target), the training
time at which 2BW's validation loss first reaches it (linear between evaluations), and that time
over Flush's whole training time. Beside it, the modelled ratio of 2BW's time per iteration to
Flush's from the schedules' replayed action lists (megatron_2bw.pipeline.schedules.timeline,
each stage's forward 1 unit, backward 2, step and transfers free: the kind of model
benchmarks/convergence.py's time axis uses), against the measured ratio.

Timing needs a quiet machine: on a shared one the figures measure the neighbours.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.pipeline import schedules as S  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES, MICROBATCHES = 2, 2


@dataclass(frozen=True)
class Recipe:
    name: str  # the study's rule name
    schedule: str  # --pipeline-schedule
    compensation: str  # --delay-compensation
    optimizer: str
    lr: float
    warmup: float  # a fraction of the iterations


@dataclass(frozen=True)
class Setup:
    iterations: int = 400
    eval_interval: int = 50
    eval_iters: int = 4
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq_length: int = 128
    micro_batch: int = 16
    seed: int = 1234


SMOKE = Setup(iterations=4, eval_interval=2, eval_iters=1, layers=2, hidden=32, heads=4,
              seq_length=16, micro_batch=2)


class InputError(ValueError):
    """Bad input: one line naming the file or flag, exit code 2."""


def recipes_from_study(path: str) -> list[Recipe]:
    """Flush's best point and the best 2BW rule's, from the convergence study's summary."""
    try:
        with open(path) as f:
            study = json.load(f)
        summary, rules = study["summary"], {r["name"]: r for r in study["setup"]["rules"]}
        best = summary["targets"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as error:
        raise InputError(f"--study {path}: expected benchmarks/convergence.py's JSON with a "
                         f"summary ({type(error).__name__}: {error})") from None
    if not best:
        raise InputError(f"--study {path}: the study has no Flush or 2BW result to take")
    recipes = []
    for key in ("flush_best", "2bw_best"):
        name, optimizer = best[key]["rule"], best[key]["optimizer"]
        row = next(r for r in summary["table"]
                   if r["schedule"] == name and r["optimizer"] == optimizer)
        rule = rules[name]
        recipes.append(Recipe(name, rule["schedule"], rule["compensation"], optimizer,
                              row["best_lr"], row["best_warmup"]))
    return recipes


def tokenizer_flags(data_dir: str) -> list[str]:
    """The quickstart's SentencePiece model, or (a corpus of token ids without one, as the smoke
    test's) NullTokenizer over the ids the data holds."""
    model = os.path.join(data_dir, "spm.model")
    if os.path.exists(model):
        return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    import numpy as np
    from megatron_2bw.data.indexed import IndexedDataset
    largest = max(int(np.max(IndexedDataset(os.path.join(data_dir, f"{split}_text_document"))[i]))
                  for split in ("train", "valid") for i in range(1))
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(largest + 1)]


def job_command(recipe: Recipe, setup: Setup, data_dir: str, log_file: str) -> list[str]:
    s = setup
    flags = [
        "--num-layers", str(s.layers), "--hidden-size", str(s.hidden),
        "--num-attention-heads", str(s.heads), "--seq-length", str(s.seq_length),
        "--max-position-embeddings", str(s.seq_length), "--hidden-dropout", "0.0",
        "--attention-dropout", "0.0", "--micro-batch-size", str(s.micro_batch),
        "--global-batch-size", str(s.micro_batch * MICROBATCHES), "--train-iters",
        str(s.iterations), "--lr", str(recipe.lr), "--min-lr", str(recipe.lr / 10),
        "--lr-warmup-iters", str(round(recipe.warmup * s.iterations)),
        "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--optimizer", recipe.optimizer, "--seed", str(s.seed),
        "--pipeline-model-parallel-size", str(STAGES), "--pipeline-schedule", recipe.schedule,
        "--train-data-path", os.path.join(data_dir, "train_text_document"),
        "--valid-data-path", os.path.join(data_dir, "valid_text_document"),
        *tokenizer_flags(data_dir),
        "--log-interval", str(s.eval_interval), "--eval-interval", str(s.eval_interval),
        "--eval-iters", str(s.eval_iters), "--log-file", log_file]
    if recipe.compensation != "none":
        flags += ["--delay-compensation", recipe.compensation]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(STAGES), os.path.join(ROOT, "pretrain_gpt.py"), *flags]


def read_log(path: str) -> dict:
    """Validation loss by iteration, and training milliseconds per iteration by log interval."""
    valid, per_iteration_ms = {}, {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if "iteration" not in record:
                continue
            if "valid/lm loss" in record:
                valid[record["iteration"]] = record["valid/lm loss"]
            if "time-per-iter-ms" in record:
                per_iteration_ms[record["iteration"]] = record["time-per-iter-ms"]
    return {"valid": valid, "time_per_iter_ms": per_iteration_ms}


def curve_of(log: dict) -> list[tuple[float, float]]:
    """(training seconds, validation loss) at each evaluation: the log intervals' time summed."""
    seconds, last, elapsed = {0: 0.0}, 0, 0.0
    for iteration in sorted(log["time_per_iter_ms"]):
        elapsed += log["time_per_iter_ms"][iteration] * (iteration - last) / 1000
        seconds[iteration], last = elapsed, iteration
    return [(seconds[i], loss) for i, loss in sorted(log["valid"].items()) if i in seconds]


def time_to_reach(curve, target: float) -> float | None:
    """Training seconds at which the curve first reaches `target` (linear between points)."""
    if curve and curve[0][1] <= target:
        return curve[0][0]
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def modelled_time_per_iteration(schedule: str) -> float:
    """Units per steady-state iteration from the replayed action lists (forward 1, backward 2)."""
    cost = {S.FORWARD: 1.0, S.BACKWARD: 2.0}

    def makespan(batches: int) -> float:
        timed = S.timeline(S.build_schedule(schedule, STAGES, MICROBATCHES, batches),
                           lambda stage, action: cost.get(action.kind, 0.0))
        return max(t.end for stage in timed for t in stage)
    return (makespan(16) - makespan(8)) / 8


def summarize(runs: dict[str, dict]) -> dict:
    flush, other = runs["flush"], runs["2bw"]
    target = flush["curve"][-1][1]
    flush_time = flush["curve"][-1][0]
    reach = time_to_reach(other["curve"], target)
    measured = {k: sum(v["time_per_iter_ms"].values()) / len(v["time_per_iter_ms"])
                for k, v in (("flush", flush["log"]), ("2bw", other["log"]))}
    modelled = modelled_time_per_iteration("2bw") / modelled_time_per_iteration("flush")
    return {"flush_final_loss": target, "flush_final_perplexity": math.exp(target),
            "flush_training_s": flush_time, "2bw_final_loss": other["curve"][-1][1],
            "2bw_training_s": other["curve"][-1][0], "2bw_s_to_flush_final": reach,
            "2bw_time_ratio": reach / flush_time if reach is not None and flush_time else None,
            "measured_time_per_iter_ratio": measured["2bw"] / measured["flush"],
            "modelled_time_per_iter_ratio": modelled}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axis = plt.subplots(figsize=(7, 4.5))
    for key, run in result["runs"].items():
        r = run["recipe"]
        axis.plot([t for t, _ in run["curve"]], [loss for _, loss in run["curve"]], marker="o",
                  label=f"{r['name']} ({r['optimizer']}, lr {r['lr']:g}, warm-up {r['warmup']:g})")
    axis.axhline(result["summary"]["flush_final_loss"], color="gray", linestyle=":",
                 linewidth=0.8)
    axis.set_xlabel("measured training seconds (evaluation excluded)")
    axis.set_ylabel("validation loss")
    axis.set_title("p = 2, m = 2, real processes (gray: Flush's final loss)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def run(recipes: list[Recipe], setup: Setup, data_dir: str, workdir: str) -> dict:
    runs = {}
    for key, recipe in zip(("flush", "2bw"), recipes):
        log_file = os.path.join(workdir, recipe.name, "log.jsonl")
        if os.path.exists(log_file):
            os.remove(log_file)  # the logger appends
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        done = subprocess.run(job_command(recipe, setup, data_dir, log_file), cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise RuntimeError(f"the {recipe.name} job failed ({done.returncode}): {tail}")
        log = read_log(log_file)
        runs[key] = {"recipe": asdict(recipe), "log": log, "curve": curve_of(log)}
    return {"setup": asdict(setup), "stages": STAGES, "microbatches": MICROBATCHES,
            "runs": runs, "summary": summarize(runs)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default="data/shakespeare")
    parser.add_argument("--study", default="docs/convergence.json",
                        help="benchmarks/convergence.py's JSON: each recipe's best grid point")
    parser.add_argument("--iterations", type=int, default=Setup.iterations)
    parser.add_argument("--workdir", default="runs/time_to_quality", help="the jobs' logs")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model for 4 iterations: the whole path, no meaningful time")
    parser.add_argument("--json", default="docs/time_to_quality.json")
    parser.add_argument("--plot", default="docs/images/time_to_quality.png")
    args = parser.parse_args(argv)
    try:
        if not os.path.exists(os.path.join(args.data_dir, "train_text_document.idx")):
            raise InputError(f"--data-dir {args.data_dir}: no prepared data: run "
                             f"examples/quickstart.sh's data steps first")
        recipes = recipes_from_study(args.study)
    except InputError as error:
        print(f"time_to_quality.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    setup = SMOKE if args.smoke else Setup(iterations=args.iterations)
    result = run(recipes, setup, args.data_dir, args.workdir)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.plot)
    print(json.dumps(result["summary"], indent=1))
    return result


if __name__ == "__main__":
    main()
