"""Time to quality of the pipeline schedules: validation loss against samples and against time.

    python benchmarks/convergence.py --workers 2        # docs/convergence.json + docs/images/convergence.png
    python benchmarks/convergence.py --quick --json /tmp/c.json --plot /tmp/c.png   # a smoke run

The same GPT (4 layers, hidden 128, 4 heads, sequence 64, untied output layer, no dropout), the
same Shakespeare data (tools/prepare_shakespeare.py, examples/quickstart.sh) and seed for every
schedule, p = 4 stages of one layer each (embeddings on the first, final norm and output layer on
the last), m = 4 microbatches of 1 per update, AdamW, warm-up then cosine decay to lr/10, clipping;
600 updates. Flush at each peak rate on the first seed, then every rule on three seeds at Flush's
best rate (each seed fixes the initial weights and the batches for every rule, so the gaps are
paired), then the rate sweep of the other rules on the first seed.

Loss against samples comes from a single-process simulation of each schedule's update rule: every
stage's parameters read, for update b, the weight version the rule names, exactly the rules that
tests/pipeline (test_compensation.py, and the PipeDream reference) prove the multi-process
executor follows. Nothing here runs a pipeline of processes: on a 2-core machine a 4-process
pipeline measures core contention, not the schedule. Rules (tau_s = p - 1 - s):

- flush    every batch on the newest weights W(b) (Flush and GPipe: the same arithmetic)
- 2bw      version max(b-1, 0) on every stage; with --delay-compensation predict or dc
           (megatron_2bw/pipeline/compensation.py)
- 2bw-predict-warmup2x  2bw-predict with twice the study's warm-up (a recipe change only)
- 2bw-predict-warmup2x-equal-time  the same recipe given Flush's modelled time instead of its
           samples: as many updates as 2BW makes in that time, warm-up and decay stretched alike
- pipedream  weight stashing: stage s reads version max(b - tau_s, 0) at forward and backward,
           clipping by each stage's own norm
- pipemare no stashing: stage s's forward reads version max(b - tau_s, 0), its backward the
           newest weights W(b) (the weights at backward time, with the forward's activations);
           T1 (pipemare-t1) divides stage s's rate by tau_s^(1 - min(b/K, 1)); T2
           (pipemare-t2) keeps delta_s <- g*delta_s + (1-g)*(W_new - W_old), g = D^(1/tau_s),
           and the backward reads W(b) - tau_s * delta_s; clipping per stage; K = 120 (a
           fifth of the run), D = 0.9; the -long rules stretch T1 over the whole run (K = 600)

Time per sample comes from replaying each schedule's own action lists
(megatron_2bw.pipeline.schedules.timeline) with per-stage forward, backward and optimizer-step
durations measured here on this model (one process, one thread, each stage on its own device
assumed, transfers free): a throughput model of the schedules, not a measurement of a pipeline.
PipeDream and PipeMare run 2BW's never-drained 1F1B order, so they take 2BW's action lists.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.config import ModelConfig, OptimizerConfig, TrainingConfig  # noqa: E402
from megatron_2bw.data.indexed import IndexedDataset  # noqa: E402
from megatron_2bw.models import build_stage_model  # noqa: E402
from megatron_2bw.optim.lr_schedule import apply_schedule  # noqa: E402
from megatron_2bw.optim.optimizer import build_torch_optimizer  # noqa: E402
from megatron_2bw.pipeline import schedules as S  # noqa: E402
from megatron_2bw.pipeline.compensation import DC_DEFAULT_LAMBDA  # noqa: E402

STAGES, MICROBATCHES, MICRO_BATCH = 4, 4, 1
T1_WARMUP, T2_DECAY = 120, 0.9  # PipeMare's K (updates) and D
T1_WHOLE_RUN = 600  # K over the whole run: the delayed stages' rates reach lr only at its end


@dataclass(frozen=True)
class Rule:
    """One schedule's update rule, as the simulation applies it."""
    name: str
    schedule: str  # whose action lists time it
    delay: str = "none"  # "none" | "uniform" (2BW) | "stage" (tau_s)
    stashing: bool = True  # False: the backward reads the newest weights (PipeMare)
    compensation: str = "none"  # 2BW: "none" | "predict" | "dc"
    per_stage_clip: bool = False
    lr_warmup_iters: int = 0  # PipeMare T1's K (0: off)
    discrepancy_decay: float = 0.0  # PipeMare T2's D (0: off)
    dc_lambda: float = DC_DEFAULT_LAMBDA
    warmup_scale: float = 1.0  # the rate's warm-up, in multiples of the study's
    # True: as many updates as this schedule makes in the modelled time Flush takes for the
    # study's updates (its warm-up and decay stretched alike), at Flush's best rate only: the
    # run a user with a fixed time budget gets
    equal_time: bool = False


RULES = [
    Rule("flush", "flush"),
    Rule("2bw", "2bw", delay="uniform"),
    Rule("2bw-predict", "2bw", delay="uniform", compensation="predict"),
    Rule("2bw-dc", "2bw", delay="uniform", compensation="dc"),
    Rule("2bw-predict-warmup2x", "2bw", delay="uniform", compensation="predict", warmup_scale=2.0),
    Rule("2bw-predict-warmup2x-equal-time", "2bw", delay="uniform", compensation="predict",
         warmup_scale=2.0, equal_time=True),
    Rule("pipedream", "2bw", delay="stage", per_stage_clip=True),
    Rule("pipemare", "2bw", delay="stage", stashing=False, per_stage_clip=True),
    Rule("pipemare-t1", "2bw", delay="stage", stashing=False, per_stage_clip=True,
         lr_warmup_iters=T1_WARMUP),
    Rule("pipemare-t2", "2bw", delay="stage", stashing=False, per_stage_clip=True,
         discrepancy_decay=T2_DECAY),
    Rule("pipemare-t1-t2", "2bw", delay="stage", stashing=False, per_stage_clip=True,
         lr_warmup_iters=T1_WARMUP, discrepancy_decay=T2_DECAY),
    Rule("pipemare-t1-long", "2bw", delay="stage", stashing=False, per_stage_clip=True,
         lr_warmup_iters=T1_WHOLE_RUN),
    Rule("pipemare-t1-t2-long", "2bw", delay="stage", stashing=False, per_stage_clip=True,
         lr_warmup_iters=T1_WHOLE_RUN, discrepancy_decay=T2_DECAY),
]
# the rules the targets are about: their seeds and their rate sweep run before the others
FIRST = ("flush", "2bw", "2bw-predict", "2bw-predict-warmup2x", "2bw-predict-warmup2x-equal-time",
         "pipemare", "pipemare-t1-t2", "pipemare-t1-t2-long")
# schedules timed: GPipe shares Flush's arithmetic, not its time
TIMED = {"flush": "flush", "gpipe": "gpipe", "2bw": "2bw"}


@dataclass
class Study:
    data_dir: str = "data/shakespeare"
    iterations: int = 600
    warmup: int = 60
    lrs: tuple = (1e-3, 2e-3, 5e-4)
    eval_interval: int = 50
    eval_sequences: int = 32
    seed: int = 1234  # the first seed: the rate sweep's
    seeds: int = 3  # at Flush's best rate, every rule runs seeds seed, seed+1, ...
    rules: list = field(default_factory=lambda: list(RULES))


def model_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64,
                       max_position_embeddings=64, vocab_size=vocab_size,
                       make_vocab_size_divisible_by=128, hidden_dropout=0.0,
                       attention_dropout=0.0, untie_embeddings_and_output_weights=True)


# -- data ----------------------------------------------------------------------------------------

class Windows:
    """Sequences of seq+1 tokens: training ones drawn at random positions of the training split
    (one fixed stream per seed), validation ones evenly spaced over the held-out plays."""

    def __init__(self, data_dir: str, seq_length: int, eval_sequences: int):
        def tokens(split):
            indexed = IndexedDataset(os.path.join(data_dir, f"{split}_text_document"))
            return np.concatenate([indexed[i] for i in range(len(indexed))]).astype(np.int64)
        self.train, valid = tokens("train"), tokens("valid")
        self.length = seq_length + 1
        starts = np.linspace(0, len(valid) - self.length, eval_sequences).astype(np.int64)
        self.valid = torch.from_numpy(np.stack([valid[s:s + self.length] for s in starts]))
        self.vocab_size = int(max(self.train.max(), valid.max())) + 1

    def batches(self, iterations: int, seed: int) -> list[list[torch.Tensor]]:
        """Every update's microbatches, drawn up front from the seed: the same for every rule."""
        starts = np.random.RandomState(seed).randint(0, len(self.train) - self.length,
                                                     size=(iterations, MICROBATCHES, MICRO_BATCH))
        return [[torch.from_numpy(np.stack([self.train[s:s + self.length] for s in micro]))
                 for micro in update] for update in starts]


# -- the simulation ------------------------------------------------------------------------------

def stage_of_parameter(name: str, num_layers: int) -> int:
    if name.startswith("embedding."):
        return 0
    if name.startswith("transformer.layers."):
        return int(name.split(".")[2]) * STAGES // num_layers
    return STAGES - 1  # final norm, output layer


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(None, {"tokens": tokens})[0]


@torch.no_grad()
def validation_loss(model, windows: Windows) -> float:
    model.eval()
    loss = float(sum(loss_of(model, chunk) for chunk in windows.valid.split(16))
                 / len(windows.valid.split(16)))
    model.train()
    return loss


class Simulation:
    """One rule at one learning rate: per-stage optimizers over the master weights W(b), the
    recent versions, and the rule's extra state (2BW's delta, PipeMare's discrepancy)."""

    def __init__(self, rule: Rule, lr: float, study: Study, model_cfg: ModelConfig,
                 opt: OptimizerConfig | None = None, seed: int | None = None):
        """`opt`: the optimizer and rate schedule (default: the study's, peak rate `lr`, the
        rule's warm-up); `seed`: the initial weights' (default: the study's first)."""
        self.rule, self.study = rule, study
        seed = study.seed if seed is None else seed
        torch.manual_seed(seed)
        self.model = build_stage_model(model_cfg, None, 1, range(model_cfg.num_layers), True, True,
                                       seed)
        named = list(self.model.named_parameters())
        self.stage = [stage_of_parameter(n, model_cfg.num_layers) for n, _ in named]
        self.master = [p.detach().clone().requires_grad_() for _, p in named]
        self.opt = opt or OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10,
                                          lr_warmup_iters=round(study.warmup * rule.warmup_scale),
                                          lr_decay_style="cosine",
                                          weight_decay=0.1, clip_grad=1.0)
        self.train = TrainingConfig(train_iters=study.iterations)
        self.optimizers = []
        for s in range(STAGES):
            params = [(n, m) for (n, _), m, st in zip(named, self.master, self.stage) if st == s]
            self.optimizers.append(build_torch_optimizer([m for _, m in params], self.opt,
                                                         [n for n, _ in params]))
        self.history = [[m.detach().clone() for m in self.master]]  # W(b-window) .. W(b)
        self.first_version = 0  # the version history[0] holds
        self.delta = [torch.zeros_like(m) for m in self.master]  # 2BW's W(b)-W(b-1); T2's EMA

    def tau(self, s: int) -> int:
        return {"none": 0, "uniform": 1, "stage": STAGES - 1 - s}[self.rule.delay]

    def weights(self, version: int) -> list[torch.Tensor]:
        return self.history[version - self.first_version]

    def forward_weights(self, b: int) -> list[torch.Tensor]:
        out = []
        for i, s in enumerate(self.stage):
            v = max(b - self.tau(s), 0)
            w = self.weights(v)[i]
            if self.rule.compensation == "predict" and v > 0:
                w = w + self.tau(s) * (w - self.weights(v - 1)[i])
            out.append(w)
        return out

    def backward_weights(self, b: int) -> list[torch.Tensor]:
        """PipeMare: the newest weights; T2 predicts them back to forward time, over the updates
        since the forward (min(b, tau_s): fewer in the first batches)."""
        return [m.detach() - min(b, self.tau(s)) * d if self.rule.discrepancy_decay > 0
                else m.detach() for m, d, s in zip(self.master, self.delta, self.stage)]

    def step(self, b: int, microbatches: list[torch.Tensor]) -> float:
        rule = self.rule
        with torch.no_grad():
            for p, w in zip(self.model.parameters(), self.forward_weights(b)):
                p.copy_(w)
        self.model.zero_grad()
        # one pass over the update's microbatches: their mean loss (equal sizes), fewer kernels
        loss = loss_of(self.model, torch.cat(microbatches))
        if not rule.stashing:  # autograd reads the weights' storage at backward time
            with torch.no_grad():
                for p, w in zip(self.model.parameters(), self.backward_weights(b)):
                    p.data.copy_(w)
        loss.backward()
        grads = [p.grad.detach().clone() for p in self.model.parameters()]
        groups = [[i for i, s in enumerate(self.stage) if s == st] for st in range(STAGES)] \
            if rule.per_stage_clip else [list(range(len(grads)))]
        for group in groups:
            norm = math.sqrt(sum(float(grads[i].pow(2).sum()) for i in group))
            if 0 < self.opt.clip_grad < norm:
                for i in group:
                    grads[i] = grads[i] * (self.opt.clip_grad / (norm + 1e-6))
        if rule.compensation == "dc":
            grads = [g + rule.dc_lambda * g * g * d for g, d in zip(grads, self.delta)]
        old = [m.detach().clone() for m in self.master]
        for s, optimizer in enumerate(self.optimizers):
            apply_schedule(optimizer.param_groups, b, self.opt, self.train)
            if rule.lr_warmup_iters and self.tau(s) >= 1:  # T1
                exponent = 1.0 - min(b / rule.lr_warmup_iters, 1.0)
                for group in optimizer.param_groups:
                    group["lr"] /= self.tau(s) ** exponent
        for m, g in zip(self.master, grads):
            m.grad = g
        for optimizer in self.optimizers:
            optimizer.step()
        with torch.no_grad():
            for i, (m, w_old) in enumerate(zip(self.master, old)):
                change = m - w_old
                if rule.discrepancy_decay > 0:  # T2's moving average of the updates
                    tau = self.tau(self.stage[i])
                    gamma = rule.discrepancy_decay ** (1.0 / tau) if tau >= 1 else 0.0
                    self.delta[i].mul_(gamma).add_(change, alpha=1.0 - gamma)
                else:
                    self.delta[i] = change
        self.history.append([m.detach().clone() for m in self.master])
        keep = STAGES + 1
        if len(self.history) > keep:
            self.history = self.history[-keep:]
            self.first_version = b + 2 - keep
        return float(loss.detach())


def run_rule(rule: Rule, lr: float, seed: int, study: Study, windows: Windows, batches) -> dict:
    sim = Simulation(rule, lr, study, model_config(windows.vocab_size), seed=seed)
    samples_per_update = MICROBATCHES * MICRO_BATCH
    curve = [(0, validation_loss(sim.model, windows))]
    for b in range(study.iterations):
        train_loss = sim.step(b, batches[b])
        if not math.isfinite(train_loss):
            curve.append(((b + 1) * samples_per_update, float("nan")))
            break
        if (b + 1) % study.eval_interval == 0 or b + 1 == study.iterations:
            with torch.no_grad():
                for p, m in zip(sim.model.parameters(), sim.master):
                    p.copy_(m)
            curve.append(((b + 1) * samples_per_update, validation_loss(sim.model, windows)))
    return {"rule": rule.name, "lr": lr, "seed": seed, "iterations": study.iterations,
            "curve": curve}


def as_run_by(rule: Rule, study: Study, time_per_sample: dict[str, float]) -> Study:
    """The study as `rule` runs it: an equal-time rule makes as many updates as its schedule
    fits in Flush's modelled time for the study's, its warm-up stretched in proportion."""
    if not rule.equal_time:
        return study
    updates = int(study.iterations * time_per_sample["flush"] / time_per_sample[rule.schedule])
    return replace(study, iterations=updates,
                   warmup=round(study.warmup * updates / study.iterations))


_DATA: dict = {}  # per process: the windows and each seed's batches


def run_job(job: tuple) -> dict:
    """One (rule, lr, seed) run, in this process or a worker of the pool."""
    rule, lr, seed, study = job
    torch.set_num_threads(1)
    if "windows" not in _DATA:
        _DATA["windows"] = Windows(study.data_dir, 64, study.eval_sequences)
    windows = _DATA["windows"]
    if (seed, study.iterations) not in _DATA:  # a longer run's first batches are a shorter's
        _DATA[(seed, study.iterations)] = windows.batches(study.iterations, seed)
    start = time.perf_counter()
    run = run_rule(rule, lr, seed, study, windows, _DATA[(seed, study.iterations)])
    run["wall_s"] = time.perf_counter() - start
    return run


# -- time per sample -----------------------------------------------------------------------------

def measure_stage_costs(study: Study, model_cfg: ModelConfig, windows: Windows,
                        repeats: int = 20) -> dict:
    """Seconds of one microbatch's forward and backward on each stage, and of each stage's
    optimizer step, timed stage by stage in one process: the fastest of `repeats` rounds, the
    one least disturbed by other processes on a shared machine."""
    torch.manual_seed(study.seed)
    stage_models = [build_stage_model(model_cfg, None, 1, range(s, s + 1), s == 0,
                                      s == STAGES - 1, study.seed) for s in range(STAGES)]
    tokens = torch.from_numpy(np.stack([windows.train[i * 65:i * 65 + 65]
                                        for i in range(MICRO_BATCH)]))
    batch = {"tokens": tokens}
    forward = [[] for _ in range(STAGES)]
    backward = [[] for _ in range(STAGES)]
    step = [[] for _ in range(STAGES)]
    opt = OptimizerConfig(optimizer="adam", lr=1e-4)
    optimizers = [build_torch_optimizer(list(m.parameters()), opt) for m in stage_models]
    for _ in range(repeats + 1):
        hidden = None
        outputs = []
        for s, model in enumerate(stage_models):
            inputs = None if hidden is None else hidden.detach().requires_grad_()
            start = time.perf_counter()
            out = model(inputs, batch)
            forward[s].append(time.perf_counter() - start)
            outputs.append((inputs, out))
            hidden = out if s < STAGES - 1 else None
        grad = None
        for s in reversed(range(STAGES)):
            inputs, out = outputs[s]
            start = time.perf_counter()
            if s == STAGES - 1:
                out[0].backward()
            else:
                torch.autograd.backward(out, grad)
            backward[s].append(time.perf_counter() - start)
            grad = None if inputs is None else inputs.grad
        for s, optimizer in enumerate(optimizers):
            start = time.perf_counter()
            optimizer.step()
            step[s].append(time.perf_counter() - start)
            optimizer.zero_grad()
    fastest = lambda xs: min(xs[1:])  # noqa: E731 - the first round warms up
    return {"forward_s": [fastest(x) for x in forward],
            "backward_s": [fastest(x) for x in backward], "step_s": [fastest(x) for x in step]}


def seconds_per_update(schedule: str, costs: dict) -> float:
    """Steady-state time of one update from the schedule's own action lists: the replayed
    makespan of 16 batches less that of 8, over 8."""
    def duration(stage: int, action: S.Action) -> float:
        if action.kind == S.FORWARD:
            return costs["forward_s"][stage]
        if action.kind == S.BACKWARD:
            return costs["backward_s"][stage]
        if action.kind == S.STEP:
            return costs["step_s"][stage]
        return 0.0

    def makespan(batches: int) -> float:
        timed = S.timeline(S.build_schedule(schedule, STAGES, MICROBATCHES, batches), duration)
        return max(t.end for stage in timed for t in stage)
    return (makespan(16) - makespan(8)) / 8


# -- analysis ------------------------------------------------------------------------------------

def final_loss(curve) -> float:
    return curve[-1][1]


def seeds_of(study: Study) -> list[int]:
    return [study.seed + i for i in range(study.seeds)]


def flush_best_lr(runs: list[dict], study: Study) -> float | None:
    """Flush's rate with the lowest final validation loss on the first seed (NaN loses)."""
    finals = {r["lr"]: final_loss(r["curve"]) for r in runs
              if r["rule"] == "flush" and r["seed"] == study.seed}
    finals = {lr: loss for lr, loss in finals.items() if math.isfinite(loss)}
    return min(finals, key=finals.get) if finals else None


def samples_to_reach(curve, target: float) -> float | None:
    """Samples at which the curve first reaches `target` (linear between evaluations)."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return s1 if l0 == l1 else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def mean_curve(curves: list) -> list:
    """The seeds' curves averaged evaluation by evaluation (NaN where a run diverged)."""
    length = max(len(c) for c in curves)
    return [(curves[0][i][0] if i < len(curves[0]) else max(c[i][0] for c in curves if i < len(c)),
             float(np.mean([c[i][1] if i < len(c) else float("nan") for c in curves])))
            for i in range(length)]


def loss_at(curve, samples: float) -> float | None:
    """The curve's loss at `samples` (linear between evaluations; None beyond its end)."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if s0 <= samples <= s1:
            return l0 + (l1 - l0) * (samples - s0) / (s1 - s0)
    return None


def spread(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "min": float(np.min(values)),
            "max": float(np.max(values)), "n": len(values)}


def summarize(runs: list[dict], time_per_sample: dict[str, float], study: Study) -> dict:
    """Each rule against Flush at Flush's best rate, seed by seed (every seed gives every rule
    the same initial weights and batches, so the gaps are paired), and each rule's own best
    rate on the first seed."""
    flush_lr = flush_best_lr(runs, study)
    run_of = {(r["rule"], r["lr"], r["seed"]): r for r in runs}
    seeds = [s for s in seeds_of(study) if ("flush", flush_lr, s) in run_of]
    flush_finals = {s: final_loss(run_of[("flush", flush_lr, s)]["curve"]) for s in seeds}
    target = float(np.mean(list(flush_finals.values()))) if seeds else float("nan")
    rows = []
    for rule in study.rules:
        own = [run_of[(rule.name, flush_lr, s)] for s in seeds
               if (rule.name, flush_lr, s) in run_of]
        sweep = {lr: final_loss(run_of[(rule.name, lr, study.seed)]["curve"]) for lr in study.lrs
                 if (rule.name, lr, study.seed) in run_of}
        finite = {lr: x for lr, x in sweep.items() if math.isfinite(x)}
        best_lr = min(finite, key=finite.get) if finite else None
        curve = mean_curve([r["curve"] for r in own]) if own else None
        # Flush's final loss on the seeds this rule ran
        own_target = float(np.mean([flush_finals[r["seed"]] for r in own])) if own else None
        reach = samples_to_reach(curve, own_target) if curve else None
        # the seeds whose own run reaches their own Flush run's final loss
        reaching = sum(samples_to_reach(r["curve"], flush_finals[r["seed"]]) is not None
                       for r in own)
        gaps = [final_loss(r["curve"]) / flush_finals[r["seed"]] - 1.0 for r in own]
        paired = [[loss / f - 1.0 for (_, loss), (_, f) in
                   zip(r["curve"], run_of[("flush", flush_lr, r["seed"])]["curve"])] for r in own]
        gap_along = [(s, float(np.mean([p[i] for p in paired if i < len(p)])))
                     for i, (s, _) in enumerate(curve)
                     if s > 0 and any(i < len(p) for p in paired)] if curve else []
        flush_curve = mean_curve([run_of[("flush", flush_lr, r["seed"])]["curve"] for r in own]) \
            if own else None
        for timing in ([rule.name] if rule.name != "flush" else ["flush", "gpipe"]):
            seconds = time_per_sample["gpipe" if timing == "gpipe" else rule.schedule]
            # Flush's loss (same seeds) at the modelled time this schedule ends its run
            flush_then = loss_at(flush_curve, curve[-1][0] * seconds / time_per_sample["flush"]) \
                if curve else None
            rows.append({
                "schedule": timing, "sweep_final_loss": {str(lr): x for lr, x in sweep.items()},
                "best_lr": best_lr, "seeds": len(own),
                "updates": max((r.get("iterations", study.iterations) for r in own), default=None),
                "final_loss": spread([final_loss(r["curve"]) for r in own]) if own else None,
                "gap": spread(gaps) if gaps else None, "gap_along_samples": gap_along,
                "mean_curve": curve, "samples_to_flush_final": reach,
                "seeds_reaching_flush_final": reaching,
                "seconds_to_flush_final": reach * seconds if reach is not None else None,
                "seconds_per_sample": seconds,
                "flush_loss_at_end_time": flush_then,
            })
    return {"flush_best_lr": flush_lr, "flush_final_loss": target, "table": rows}


def render_markdown(result: dict) -> str:
    summary = result["summary"]
    lrs = result["setup"]["lrs"]
    fmt = lambda x, f: "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
        else format(x, f)  # noqa: E731
    pct = lambda x: "-" if x is None else f"{100 * x:+.1f}%"  # noqa: E731
    sweep = ["| schedule | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
             "|---|" + "---|" * len(lrs)]
    for row in summary["table"]:
        if row["schedule"] != "gpipe":
            sweep.append(f"| {row['schedule']} | " + " | ".join(
                fmt(row["sweep_final_loss"].get(str(lr)), ".3f") for lr in lrs) + " |")
    lines = [f"Final validation loss by peak rate (first seed, {result['setup']['seeds'][0]}):",
             "", *sweep, "",
             f"At Flush's best rate ({fmt(summary['flush_best_lr'], 'g')}), over "
             f"{len(result['setup']['seeds'])} seeds: mean [min, max]; gaps paired seed by seed; "
             f"time from each schedule's replayed action lists:", "",
             "| schedule | best lr | seeds | updates | final loss | vs Flush (final) "
             "| vs Flush at 1/4, 1/2, 3/4 | samples to Flush's final (mean curve; seeds that reach it) "
             "| modelled s to Flush's final | modelled ms/sample | Flush at its end time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["table"]:
        final, gap = row["final_loss"], row["gap"]
        along = row["gap_along_samples"]
        quarters = [along[max(0, round(len(along) * q) - 1)][1] for q in (0.25, 0.5, 0.75)] \
            if along else []
        lines.append(
            f"| {row['schedule']} | {fmt(row['best_lr'], 'g')} | {row['seeds']} "
            f"| {fmt(row['updates'], 'd')} "
            f"| {fmt(final and final['mean'], '.3f')} [{fmt(final and final['min'], '.3f')}, "
            f"{fmt(final and final['max'], '.3f')}] "
            f"| {pct(gap and gap['mean'])} [{pct(gap and gap['min'])}, {pct(gap and gap['max'])}] "
            f"| {', '.join(pct(q) for q in quarters) or '-'} "
            f"| {fmt(row['samples_to_flush_final'], '.0f')} "
            f"({row['seeds_reaching_flush_final']} of {row['seeds']} seeds) "
            f"| {fmt(row['seconds_to_flush_final'], '.1f')} "
            f"| {fmt(row['seconds_per_sample'] * 1e3, '.2f')} "
            f"| {fmt(row['flush_loss_at_end_time'], '.3f')} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summary = result["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    names = [rule["name"] for rule in result["setup"]["rules"]]
    # PipeMare's rules dashed, in colours of their own: more rules than ten colours
    dashed = [name for name in names if name.startswith("pipemare")]
    solid = [name for name in names if name not in dashed]
    colors = {name: f"C{i % 10}" for group in (solid, dashed) for i, name in enumerate(group)}
    lines = {name: "--" if name in dashed else "-" for name in names}
    lowest = []
    for row in summary["table"]:
        curve = row["mean_curve"]
        if not curve:
            continue
        name = "flush" if row["schedule"] == "gpipe" else row["schedule"]
        samples = [s for s, _ in curve]
        losses = [loss for _, loss in curve]
        lowest.append(np.nanmin(losses))
        style = ":" if row["schedule"] == "gpipe" else lines[name]
        if row["schedule"] != "gpipe":
            left.plot(samples, losses, label=name, color=colors[name], linestyle=style)
        right.plot([s * row["seconds_per_sample"] for s in samples], losses,
                   label=row["schedule"], color=colors[name], linestyle=style)
    for axis in (left, right):
        axis.axhline(summary["flush_final_loss"], color="gray", linewidth=0.8, linestyle=":")
        axis.set_ylabel("validation loss (mean over seeds)")
        if lowest:
            axis.set_ylim(min(lowest) - 0.05, min(lowest) + 1.2)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, ncol=2)
    left.set_xlabel("samples")
    right.set_xlabel("modelled seconds (p = 4, replayed action lists)")
    lr = summary["flush_best_lr"]
    left.set_title(f"validation loss vs samples (lr {lr:g}, Flush's best)")
    right.set_title("validation loss vs time (gray: Flush's final loss)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def run_jobs(jobs: list[tuple], workers: int, done: callable) -> None:
    """Run `jobs` (rule, lr, seed, study), `workers` processes of one thread each; `done(run)`
    after each, in completion order."""
    if workers <= 1:
        for job in jobs:
            done(run_job(job))
        return
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for run in pool.imap_unordered(run_job, jobs):
            done(run)


def run_study(study: Study, json_path: str | None = None, new_runs: bool = True,
              workers: int = 1) -> dict:
    """Flush at every rate on the first seed; then at Flush's best rate every rule on the first
    seed; then the other seeds there and the other rates on the first seed (the sweep), the
    rules in FIRST before the rest, all in one pool so no worker waits for a phase. With
    `json_path` the result so far is written after each run and runs already there are kept;
    `new_runs=False` only summarizes those."""
    torch.set_num_threads(1)
    windows = Windows(study.data_dir, 64, study.eval_sequences)
    setup = {"iterations": study.iterations, "warmup": study.warmup, "lrs": list(study.lrs),
             "stages": STAGES, "microbatches": MICROBATCHES, "micro_batch_size": MICRO_BATCH,
             "seeds": seeds_of(study), "eval_interval": study.eval_interval,
             "eval_sequences": study.eval_sequences, "rules": [r.__dict__ for r in study.rules]}
    result = {"setup": setup, "runs": []}
    if json_path and os.path.exists(json_path):
        with open(json_path) as f:
            saved = json.load(f)
        result = kept_from(saved, setup)
    if "stage_costs" not in result:
        costs = measure_stage_costs(study, model_config(windows.vocab_size), windows)
        result["stage_costs"] = costs
        result["time_per_sample_s"] = {
            name: seconds_per_update(schedule, costs) / (MICROBATCHES * MICRO_BATCH)
            for name, schedule in TIMED.items()}
    flush = next(rule for rule in study.rules if rule.name == "flush")
    started = time.perf_counter()

    def done(run: dict) -> None:
        result["runs"].append(run)
        print(f"[{len(result['runs'])} runs, {time.perf_counter() - started:.0f} s] "
              f"{run['rule']:22s} lr {run['lr']:g} seed {run['seed']}: final validation loss "
              f"{final_loss(run['curve']):.4f} ({run['wall_s']:.0f} s)", flush=True)
        if json_path:
            write_json(result, json_path)

    def pending(jobs):
        have = {(r["rule"], r["lr"], r["seed"]) for r in result["runs"]}
        return [j for j in jobs if (j[0].name, j[1], j[2]) not in have] if new_runs else []

    run_jobs(pending([(flush, lr, study.seed, study) for lr in study.lrs]), workers, done)
    flush_lr = flush_best_lr(result["runs"], study)
    if flush_lr is not None:
        first = [rule for rule in study.rules if rule.name in FIRST]
        rest = [rule for rule in study.rules if rule.name not in FIRST]
        later_seeds = seeds_of(study)[1:]
        other_lrs = [lr for lr in study.lrs if lr != flush_lr]
        timed = result["time_per_sample_s"]
        jobs = [(rule, flush_lr, study.seed, as_run_by(rule, study, timed))
                for rule in study.rules]
        for rules in (first, rest):
            jobs += [(rule, flush_lr, seed, as_run_by(rule, study, timed))
                     for seed in later_seeds for rule in rules]
            jobs += [(rule, lr, study.seed, study) for lr in other_lrs for rule in rules
                     if not rule.equal_time]
        run_jobs(pending(jobs), workers, done)
    result["summary"] = summarize(result["runs"], result["time_per_sample_s"], study)
    return result


def kept_from(saved: dict, setup: dict) -> dict:
    """What a saved study still holds for `setup`: with the same setup but for its list of rules,
    the saved runs (and stage timings) of the rules whose definition is unchanged; else nothing."""
    others = lambda d: {k: v for k, v in d.items() if k != "rules"}  # noqa: E731
    if others(saved.get("setup", {})) != others(setup):
        return {"setup": setup, "runs": []}
    # a field added since the save reads as its default
    rule_then = {r["name"]: Rule(**r) for r in saved["setup"]["rules"]}
    unchanged = {r["name"] for r in setup["rules"] if rule_then.get(r["name"]) == Rule(**r)}
    kept = {k: v for k, v in saved.items() if k not in ("setup", "runs", "summary")}
    return {**kept, "setup": setup, "runs": [r for r in saved["runs"] if r["rule"] in unchanged]}


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default="data/shakespeare")
    parser.add_argument("--iterations", type=int, default=Study.iterations)
    parser.add_argument("--warmup", type=int, default=Study.warmup)
    parser.add_argument("--lrs", type=float, nargs="+", default=list(Study.lrs),
                        help="peak rates of the sweep")
    parser.add_argument("--seeds", type=int, default=Study.seeds,
                        help="seeds per rule at Flush's best rate")
    parser.add_argument("--workers", type=int, default=1,
                        help="runs side by side, one process of one thread each")
    parser.add_argument("--quick", action="store_true",
                        help="a few iterations at one rate (a smoke test of the whole path)")
    parser.add_argument("--json", default="docs/convergence.json",
                        help="the result; runs already in it (same setup) are kept, not rerun")
    parser.add_argument("--report-only", action="store_true",
                        help="no new runs: the table and the picture from the runs in --json")
    parser.add_argument("--plot", default="docs/images/convergence.png")
    args = parser.parse_args(argv)
    study = Study(data_dir=args.data_dir, iterations=args.iterations, warmup=args.warmup,
                  lrs=tuple(args.lrs), seeds=args.seeds)
    if args.quick:
        study = replace(study, iterations=4, warmup=1, lrs=(1e-3, 2e-3), eval_interval=2,
                        eval_sequences=4, seeds=2)
    if not os.path.exists(os.path.join(study.data_dir, "train_text_document.idx")):
        print(f"convergence.py: error: no prepared data in {study.data_dir}: run "
              f"examples/quickstart.sh's data steps (tools/prepare_shakespeare.py, "
              f"tools/train_tokenizer.py, tools/preprocess_data.py) first", file=sys.stderr)
        sys.exit(2)
    result = run_study(study, args.json, new_runs=not args.report_only, workers=args.workers)
    write_json(result, args.json)
    plot(result, args.plot)
    print(render_markdown(result))


if __name__ == "__main__":
    main()
