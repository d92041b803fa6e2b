"""Time to quality of the pipeline schedules at an equal tuning budget: validation loss against
samples and against modelled time.

    python benchmarks/convergence.py --workers 2        # docs/convergence.json + docs/images/convergence.png
    python benchmarks/convergence.py --quick --json /tmp/c.json --plot /tmp/c.png   # a smoke run

The same GPT (4 layers, hidden 64, 4 heads, sequence 64, untied output layer, no dropout), the
same Shakespeare data (tools/prepare_shakespeare.py, examples/quickstart.sh) for every rule,
p = 4 stages of one layer each (embeddings on the first, final norm and output layer on the
last), m = 4 microbatches of 1 per update, warm-up then cosine decay to lr/10, weight decay 0.1,
clipping at 1.0; 100 updates. The model and run length are sized so that the whole grid (2 rates
x 2 warm-ups x 5 seeds per rule) runs in tens of minutes on two shared cores: short runs of a
small model, so the comparison holds for this protocol, not for long pretraining.

The protocol, fixed before any run: every rule and optimizer gets the same grid (every peak
rate in --lrs times every warm-up in --warmups, a fraction of the updates) on the same seeds
(each seed fixes the initial weights and the batches, the same for every rule, so gaps are
paired). A rule's best point is the grid point with the lowest validation loss at the end,
averaged over the seeds (a run that diverges makes its point lose). Loss and perplexity
(exp(loss)) are reported at each rule's best point.

Loss against samples comes from a single-process simulation of each schedule's update rule: every
stage's parameters read, for update b, the weight version the rule names, exactly the rules that
tests/pipeline (test_compensation.py, test_pipemare.py and the PipeDream reference) prove the
multi-process executor follows. Nothing here runs a pipeline of processes: on a 2-core machine a
4-process pipeline measures core contention, not the schedule. Rules (w_s = p - 1 - s):

- flush    every batch on the newest weights W(b) (Flush and GPipe: the same arithmetic)
- 2bw      version max(b-1, 0) on every stage; with --delay-compensation predict, dc, ef or
           nesterov (megatron_2bw/pipeline/compensation.py)
- pipedream  weight stashing: stage s reads version max(b - w_s, 0) at forward and backward,
           clipping by each stage's own norm
- pipemare no stashing: the forward of microbatch k = b*m + j on stage s reads version
           max(floor((k - w_s) / m), 0) (the runtime's rule, megatron_2bw/pipeline/pipemare.py),
           its backward the newest weights W(b); T1 (pipemare-t1-t2) divides stage s's rate by
           tau_s^(1 - min(b/K, 1)), tau_s = ceil(w_s / m); T2 keeps
           delta_s <- g*delta_s + (1-g)*(W_new - W_old), g = D^(1/tau_s), and the backward of
           microbatch k reads W(b) - d_k * delta_s (d_k its own delay); clipping per stage;
           K = a fifth of the run, D = 0.9

Time per sample comes from replaying each schedule's own action lists
(megatron_2bw.pipeline.schedules.timeline) with per-stage forward, backward and optimizer-step
durations measured here on this model (one process, one thread, each stage on its own device
assumed, transfers free): a throughput model of the schedules, not a measurement of a pipeline
(benchmarks/time_to_quality.py measures real processes). PipeDream and PipeMare run 2BW's
never-drained 1F1B order, so they take 2BW's action lists.
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
from megatron_2bw.pipeline.compensation import DEFAULT_COEFFICIENT  # noqa: E402

STAGES, MICROBATCHES, MICRO_BATCH = 4, 4, 1
T2_DECAY = 0.9  # PipeMare's D; T1's K is a fifth of the run


@dataclass(frozen=True)
class Rule:
    """One schedule's update rule, as the simulation applies it."""
    name: str
    schedule: str  # whose action lists time it
    delay: str = "none"  # "none" | "uniform" (2BW) | "stage" (w_s; PipeMare: per microbatch)
    stashing: bool = True  # False: the backward reads the newest weights (PipeMare)
    compensation: str = "none"  # 2BW: "none" | "predict" | "dc" | "ef" | "nesterov"
    per_stage_clip: bool = False
    lr_warmup_iters: int = 0  # PipeMare T1's K (0: off; -1: a fifth of the run)
    discrepancy_decay: float = 0.0  # PipeMare T2's D (0: off)
    coefficient: float | None = None  # dc's lambda, ef's beta, nesterov's gamma (None: default)


RULES = [
    Rule("flush", "flush"),
    Rule("2bw", "2bw", delay="uniform"),
    Rule("2bw-predict", "2bw", delay="uniform", compensation="predict"),
    Rule("2bw-dc", "2bw", delay="uniform", compensation="dc"),
    Rule("2bw-ef", "2bw", delay="uniform", compensation="ef"),
    Rule("2bw-nesterov", "2bw", delay="uniform", compensation="nesterov"),
    Rule("pipedream", "2bw", delay="stage", per_stage_clip=True),
    Rule("pipemare", "2bw", delay="stage", stashing=False, per_stage_clip=True),
    Rule("pipemare-t1-t2", "2bw", delay="stage", stashing=False, per_stage_clip=True,
         lr_warmup_iters=-1, discrepancy_decay=T2_DECAY),
]
# the rules the study runs by default (--rules adds pipedream, pipemare-t1-t2)
STUDIED = ("flush", "2bw", "2bw-predict", "2bw-dc", "2bw-ef", "2bw-nesterov", "pipemare")
# schedules timed: GPipe shares Flush's arithmetic, not its time
TIMED = {"flush": "flush", "gpipe": "gpipe", "2bw": "2bw"}


@dataclass
class Study:
    data_dir: str = "data/shakespeare"
    iterations: int = 100
    warmups: tuple = (0.05, 0.2)  # warm-up lengths, fractions of the updates
    lrs: tuple = (2e-3, 4e-3)
    optimizers: tuple = ("adam",)
    eval_interval: int = 25
    eval_sequences: int = 32
    seed: int = 1234  # seeds seed, seed+1, ...
    seeds: int = 5
    hidden_size: int = 64
    rules: list = field(default_factory=lambda: [r for r in RULES if r.name in STUDIED])


def model_config(vocab_size: int, hidden_size: int = Study.hidden_size) -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=hidden_size, num_attention_heads=4, seq_length=64,
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


def pipemare_forward_version(b: int, j: int, stage: int, m: int = MICROBATCHES) -> int:
    """The version microbatch j of batch b reads at its forward on `stage` under PipeMare: its
    forward follows the backwards of microbatches 0 .. k - w_s - 1 (k = b*m + j), and a stage
    steps after each batch's last backward."""
    return max((b * m + j - (STAGES - 1 - stage)) // m, 0)


class Simulation:
    """One rule at one learning rate: per-stage optimizers over the master weights W(b), the
    recent versions, and the rule's extra state (2BW's delta and ef's last step, PipeMare's
    discrepancy)."""

    def __init__(self, rule: Rule, lr: float, study: Study, model_cfg: ModelConfig,
                 opt: OptimizerConfig | None = None, seed: int | None = None,
                 warmup: float | None = None, optimizer: str = "adam"):
        """`opt`: the optimizer and rate schedule (default: `optimizer` at peak rate `lr`, a
        warm-up of `warmup` of the updates (default the study's first)); `seed`: the initial
        weights' (default: the study's first)."""
        self.rule, self.study = rule, study
        seed = study.seed if seed is None else seed
        torch.manual_seed(seed)
        self.model = build_stage_model(model_cfg, None, 1, range(model_cfg.num_layers), True, True,
                                       seed)
        named = list(self.model.named_parameters())
        self.stage = [stage_of_parameter(n, model_cfg.num_layers) for n, _ in named]
        self.master = [p.detach().clone().requires_grad_() for _, p in named]
        warmup = study.warmups[0] if warmup is None else warmup
        self.opt = opt or OptimizerConfig(optimizer=optimizer, lr=lr, min_lr=lr / 10,
                                          lr_warmup_iters=round(study.iterations * warmup),
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
        self.last_step = [torch.zeros_like(m) for m in self.master]  # ef's u_{b-1}
        self.coefficient = rule.coefficient if rule.coefficient is not None \
            else DEFAULT_COEFFICIENT.get(rule.compensation)
        self.t1_iters = study.iterations // 5 if rule.lr_warmup_iters < 0 else rule.lr_warmup_iters
        self.m = MICROBATCHES  # per update; step() takes it from its microbatches

    def tau(self, s: int) -> int:
        """The stage's delay in updates (PipeMare: its largest, ceil(w_s / m), for T1 and T2)."""
        if not self.rule.stashing:
            return -(-(STAGES - 1 - s) // self.m)
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

    def _copy_in(self, weights: list[torch.Tensor], storage: bool = False) -> None:
        with torch.no_grad():
            for p, w in zip(self.model.parameters(), weights):
                (p.data if storage else p).copy_(w)

    def _pipemare_loss(self, b: int, microbatches: list[torch.Tensor]) -> float:
        """Microbatch by microbatch: the forward on the version the runtime's rule names, the
        backward on W(b) (T2: predicted back by the microbatch's own delay d_k)."""
        total = 0.0
        for j, tokens in enumerate(microbatches):
            versions = [pipemare_forward_version(b, j, s, self.m) for s in self.stage]
            self._copy_in([self.weights(v)[i] for i, v in enumerate(versions)])
            loss = loss_of(self.model, tokens) / len(microbatches)
            # autograd reads the weights' storage at backward time
            self._copy_in([m.detach() - (b - v) * d if self.rule.discrepancy_decay > 0
                           else m.detach() for m, d, v in zip(self.master, self.delta, versions)],
                          storage=True)
            loss.backward()
            total += float(loss.detach())
        return total

    def step(self, b: int, microbatches: list[torch.Tensor]) -> float:
        rule = self.rule
        self.m = len(microbatches)
        self.model.zero_grad()
        if rule.stashing:
            self._copy_in(self.forward_weights(b))
            # one pass over the update's microbatches: their mean loss (equal sizes), fewer kernels
            loss = loss_of(self.model, torch.cat(microbatches))
            loss.backward()
            loss = float(loss.detach())
        else:
            loss = self._pipemare_loss(b, microbatches)
        grads = [p.grad.detach().clone() for p in self.model.parameters()]
        groups = [[i for i, s in enumerate(self.stage) if s == st] for st in range(STAGES)] \
            if rule.per_stage_clip else [list(range(len(grads)))]
        for group in groups:
            norm = math.sqrt(sum(float(grads[i].pow(2).sum()) for i in group))
            if 0 < self.opt.clip_grad < norm:
                for i in group:
                    grads[i] = grads[i] * (self.opt.clip_grad / (norm + 1e-6))
        if rule.compensation == "dc":
            grads = [g + self.coefficient * g * g * d for g, d in zip(grads, self.delta)]
        old = [m.detach().clone() for m in self.master]
        if rule.compensation == "nesterov":  # the step starts from the look-ahead point
            with torch.no_grad():
                for m, d in zip(self.master, self.delta):
                    m.add_(d, alpha=self.coefficient)
        for s, optimizer in enumerate(self.optimizers):
            apply_schedule(optimizer.param_groups, b, self.opt, self.train)
            if self.t1_iters and self.tau(s) >= 1:  # T1
                exponent = 1.0 - min(b / self.t1_iters, 1.0)
                for group in optimizer.param_groups:
                    group["lr"] /= self.tau(s) ** exponent
        for m, g in zip(self.master, grads):
            m.grad = g
        for optimizer in self.optimizers:
            optimizer.step()
        with torch.no_grad():
            if rule.compensation == "ef":  # W(b+1) = W(b) + u + beta * (u - u_previous)
                for i, (m, w_old) in enumerate(zip(self.master, old)):
                    u = m - w_old
                    m.add_(u - self.last_step[i], alpha=self.coefficient)
                    self.last_step[i] = u
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
        return loss


def run_rule(rule: Rule, optimizer: str, lr: float, warmup: float, seed: int, study: Study,
             windows: Windows, batches) -> dict:
    sim = Simulation(rule, lr, study, model_config(windows.vocab_size, study.hidden_size),
                     seed=seed, warmup=warmup, optimizer=optimizer)
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
    return {"rule": rule.name, "optimizer": optimizer, "lr": lr, "warmup": warmup, "seed": seed,
            "iterations": study.iterations, "curve": curve}


_DATA: dict = {}  # per process: the windows and each seed's batches


def run_job(job: tuple) -> dict:
    """One (rule, optimizer, lr, warm-up, seed) run, in this process or a worker of the pool."""
    rule, optimizer, lr, warmup, seed, study = job
    torch.set_num_threads(1)
    if "windows" not in _DATA:
        _DATA["windows"] = Windows(study.data_dir, 64, study.eval_sequences)
    windows = _DATA["windows"]
    if (seed, study.iterations) not in _DATA:
        _DATA[(seed, study.iterations)] = windows.batches(study.iterations, seed)
    start = time.perf_counter()
    run = run_rule(rule, optimizer, lr, warmup, seed, study, windows,
                   _DATA[(seed, study.iterations)])
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


def grid_of(study: Study) -> list[tuple[float, float]]:
    return [(lr, warmup) for lr in study.lrs for warmup in study.warmups]


def point_key(lr: float, warmup: float) -> str:
    return f"lr {lr:g}, warm-up {warmup:g}"


def grid_means(runs: list[dict], rule: str, optimizer: str, study: Study) -> dict:
    """Mean final validation loss over the seeds at every grid point all seeds ran (a diverged
    run makes its point's mean NaN)."""
    finals: dict = {}
    for r in runs:
        if r["rule"] == rule and r.get("optimizer", "adam") == optimizer:
            finals.setdefault((r["lr"], r["warmup"]), {})[r["seed"]] = final_loss(r["curve"])
    seeds = seeds_of(study)
    return {point: float(np.mean([by_seed[s] for s in seeds]))
            for point, by_seed in finals.items() if all(s in by_seed for s in seeds)}


def best_point(means: dict) -> tuple[float, float] | None:
    """The grid point with the lowest mean final loss (NaN loses)."""
    finite = {p: x for p, x in means.items() if math.isfinite(x)}
    return min(finite, key=finite.get) if finite else None


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
    """Every rule and optimizer at its own best grid point; gaps to Flush's best point (same
    optimizer) paired seed by seed; the targets' comparison: 2BW's best (any correction, any
    optimizer) against Flush's best (any optimizer), mean over the seeds."""
    seeds = seeds_of(study)
    run_of = {(r["rule"], r.get("optimizer", "adam"), r["lr"], r["warmup"], r["seed"]): r
              for r in runs}

    def at(rule, optimizer, point):
        return [run_of[(rule, optimizer, *point, s)] for s in seeds] if point else []

    flush = {}  # optimizer -> (point, runs)
    for optimizer in study.optimizers:
        point = best_point(grid_means(runs, "flush", optimizer, study))
        flush[optimizer] = (point, at("flush", optimizer, point))
    rows = []
    for optimizer in study.optimizers:
        flush_point, flush_runs = flush[optimizer]
        flush_finals = [final_loss(r["curve"]) for r in flush_runs]
        target = float(np.mean(flush_finals)) if flush_runs else None
        flush_curve = mean_curve([r["curve"] for r in flush_runs]) if flush_runs else None
        for rule in study.rules:
            means = grid_means(runs, rule.name, optimizer, study)
            point = best_point(means)
            own = at(rule.name, optimizer, point)
            finals = [final_loss(r["curve"]) for r in own]
            curve = mean_curve([r["curve"] for r in own]) if own else None
            gaps = [x / f - 1.0 for x, f in zip(finals, flush_finals)] if flush_runs else []
            reach = samples_to_reach(curve, target) if curve and target else None
            for timing in ([rule.name] if rule.name != "flush" else ["flush", "gpipe"]):
                seconds = time_per_sample["gpipe" if timing == "gpipe" else rule.schedule]
                flush_then = loss_at(flush_curve, curve[-1][0] * seconds /
                                     time_per_sample["flush"]) if curve and flush_curve else None
                rows.append({
                    "schedule": timing, "optimizer": optimizer,
                    "grid_mean_final_loss": {point_key(*p): x for p, x in sorted(means.items())},
                    "best_lr": point and point[0], "best_warmup": point and point[1],
                    "seeds": len(own),
                    "final_loss": spread(finals) if own else None,
                    "perplexity": spread([math.exp(x) for x in finals]) if own else None,
                    "gap": spread(gaps) if gaps else None,
                    "mean_curve": curve, "samples_to_flush_final": reach,
                    "seconds_to_flush_final": reach * seconds if reach is not None else None,
                    "seconds_per_sample": seconds, "flush_loss_at_end_time": flush_then})
    finals = {(row["schedule"], row["optimizer"]): row["final_loss"]["mean"] for row in rows
              if row["final_loss"] and math.isfinite(row["final_loss"]["mean"])}
    flush_best = min(((k, x) for k, x in finals.items() if k[0] == "flush"),
                     key=lambda kx: kx[1], default=None)
    async_best = min(((k, x) for k, x in finals.items() if k[0].startswith("2bw")),
                     key=lambda kx: kx[1], default=None)
    targets = None
    if flush_best and async_best:
        gap = async_best[1] / flush_best[1] - 1.0
        targets = {"flush_best": {"rule": flush_best[0][0], "optimizer": flush_best[0][1],
                                  "loss": flush_best[1], "perplexity": math.exp(flush_best[1])},
                   "2bw_best": {"rule": async_best[0][0], "optimizer": async_best[0][1],
                                "loss": async_best[1], "perplexity": math.exp(async_best[1])},
                   "loss_gap": gap,
                   "perplexity_gap": math.exp(async_best[1] - flush_best[1]) - 1.0,
                   "within_half_percent": gap <= 0.005}
    return {"flush_best_point": {o: flush[o][0] for o in study.optimizers}, "table": rows,
            "targets": targets}


def render_markdown(result: dict) -> str:
    summary = result["summary"]
    setup = result["setup"]
    points = [point_key(lr, w) for lr in setup["lrs"] for w in setup["warmups"]]
    fmt = lambda x, f: "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
        else format(x, f)  # noqa: E731
    pct = lambda x: "-" if x is None else f"{100 * x:+.2f}%"  # noqa: E731
    grid = ["| rule | optimizer | " + " | ".join(points) + " |",
            "|---|---|" + "---|" * len(points)]
    best = ["| rule | optimizer | best lr | best warm-up | final loss mean [min, max] "
            "| perplexity mean | vs Flush's best (paired) | samples to Flush's final "
            "| modelled s to Flush's final | modelled ms/sample | Flush at its end time |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["table"]:
        final, gap, ppl = row["final_loss"], row["gap"], row["perplexity"]
        if row["schedule"] != "gpipe":
            grid.append(f"| {row['schedule']} | {row['optimizer']} | " + " | ".join(
                fmt(row["grid_mean_final_loss"].get(p), ".4f") for p in points) + " |")
        best.append(
            f"| {row['schedule']} | {row['optimizer']} | {fmt(row['best_lr'], 'g')} "
            f"| {fmt(row['best_warmup'], 'g')} "
            f"| {fmt(final and final['mean'], '.4f')} [{fmt(final and final['min'], '.4f')}, "
            f"{fmt(final and final['max'], '.4f')}] | {fmt(ppl and ppl['mean'], '.1f')} "
            f"| {pct(gap and gap['mean'])} [{pct(gap and gap['min'])}, {pct(gap and gap['max'])}] "
            f"| {fmt(row['samples_to_flush_final'], '.0f')} "
            f"| {fmt(row['seconds_to_flush_final'], '.2f')} "
            f"| {fmt(row['seconds_per_sample'] * 1e3, '.3f')} "
            f"| {fmt(row['flush_loss_at_end_time'], '.4f')} |")
    lines = [f"Mean final validation loss over {len(setup['seeds'])} seeds at every grid point "
             f"(peak rate, warm-up as a fraction of {setup['iterations']} updates):", "", *grid, "",
             "Each rule at its best grid point:", "", *best]
    t = summary["targets"]
    if t:
        lines += ["", f"2BW's best ({t['2bw_best']['rule']}, {t['2bw_best']['optimizer']}): "
                  f"loss {t['2bw_best']['loss']:.4f}, "
                  f"perplexity {t['2bw_best']['perplexity']:.1f}; "
                  f"Flush's best ({t['flush_best']['optimizer']}): loss "
                  f"{t['flush_best']['loss']:.4f}, perplexity {t['flush_best']['perplexity']:.1f}; "
                  f"gap {pct(t['loss_gap'])} in loss, {pct(t['perplexity_gap'])} in perplexity: "
                  f"within 0.5%: {'yes' if t['within_half_percent'] else 'no'}"]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summary = result["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    names = sorted({(row["schedule"], row["optimizer"]) for row in summary["table"]
                    if row["schedule"] != "gpipe"})
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
    lowest = []
    for row in summary["table"]:
        curve = row["mean_curve"]
        if not curve:
            continue
        name = ("flush" if row["schedule"] == "gpipe" else row["schedule"], row["optimizer"])
        label = f"{row['schedule']} ({row['optimizer']})"
        samples = [s for s, _ in curve]
        losses = [loss for _, loss in curve]
        lowest.append(np.nanmin(losses))
        style = ":" if row["schedule"] == "gpipe" else "--" if name[0].startswith("pipe") else "-"
        if row["schedule"] != "gpipe":
            left.plot(samples, losses, label=label, color=colors[name], linestyle=style)
        right.plot([s * row["seconds_per_sample"] for s in samples], losses, label=label,
                   color=colors[name], linestyle=style)
    for axis in (left, right):
        t = summary["targets"]
        if t:
            axis.axhline(t["flush_best"]["loss"], color="gray", linewidth=0.8, linestyle=":")
        axis.set_ylabel("validation loss (mean over seeds, each at its best grid point)")
        if lowest:
            axis.set_ylim(min(lowest) - 0.05, min(lowest) + 1.0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, ncol=2)
    left.set_xlabel("samples")
    right.set_xlabel("modelled seconds (p = 4, replayed action lists)")
    left.set_title("validation loss vs samples")
    right.set_title("validation loss vs modelled time (gray: Flush's best final loss)")
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
    """Every rule and optimizer at every grid point on every seed, seed by seed (so an
    interrupted study holds whole seeds). With `json_path` the result so far is written after
    each run and runs already there are kept; `new_runs=False` only summarizes those."""
    torch.set_num_threads(1)
    windows = Windows(study.data_dir, 64, study.eval_sequences)
    setup = {"iterations": study.iterations, "warmups": list(study.warmups),
             "lrs": list(study.lrs), "optimizers": list(study.optimizers),
             "hidden_size": study.hidden_size, "stages": STAGES, "microbatches": MICROBATCHES,
             "micro_batch_size": MICRO_BATCH, "seeds": seeds_of(study),
             "eval_interval": study.eval_interval, "eval_sequences": study.eval_sequences,
             "rules": [r.__dict__ for r in study.rules]}
    result = {"setup": setup, "runs": []}
    if json_path and os.path.exists(json_path):
        with open(json_path) as f:
            saved = json.load(f)
        result = kept_from(saved, setup)
    if "stage_costs" not in result:
        costs = measure_stage_costs(study, model_config(windows.vocab_size, study.hidden_size),
                                    windows)
        result["stage_costs"] = costs
        result["time_per_sample_s"] = {
            name: seconds_per_update(schedule, costs) / (MICROBATCHES * MICRO_BATCH)
            for name, schedule in TIMED.items()}
    started = time.perf_counter()

    def done(run: dict) -> None:
        result["runs"].append(run)
        print(f"[{len(result['runs'])} runs, {time.perf_counter() - started:.0f} s] "
              f"{run['rule']:15s} {run['optimizer']} lr {run['lr']:g} warm-up {run['warmup']:g} "
              f"seed {run['seed']}: final validation loss {final_loss(run['curve']):.4f} "
              f"({run['wall_s']:.0f} s)", flush=True)
        if json_path:
            write_json(result, json_path)

    have = {(r["rule"], r["optimizer"], r["lr"], r["warmup"], r["seed"]) for r in result["runs"]}
    jobs = [(rule, optimizer, lr, warmup, seed, study) for seed in seeds_of(study)
            for optimizer in study.optimizers for rule in study.rules
            for lr, warmup in grid_of(study)
            if (rule.name, optimizer, lr, warmup, seed) not in have]
    run_jobs(jobs if new_runs else [], workers, done)
    result["summary"] = summarize(result["runs"], result["time_per_sample_s"], study)
    return result


def kept_from(saved: dict, setup: dict) -> dict:
    """What a saved study still holds for `setup`: with the same setup but for its lists of
    rules, optimizers and seeds (runs are keyed by those), the saved runs (and stage timings) of
    the rules whose definition is unchanged; else nothing."""
    others = lambda d: {k: v for k, v in d.items()  # noqa: E731
                        if k not in ("rules", "optimizers", "seeds")}
    if others(saved.get("setup", {})) != others(setup):
        return {"setup": setup, "runs": []}

    def rule(fields: dict) -> Rule | None:  # a field added since reads as its default
        try:
            return Rule(**fields)
        except TypeError:  # a field removed since: the rule has changed
            return None
    rule_then = {r["name"]: rule(r) for r in saved["setup"]["rules"]}
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
    parser.add_argument("--lrs", type=float, nargs="+", default=list(Study.lrs),
                        help="peak rates of the grid")
    parser.add_argument("--warmups", type=float, nargs="+", default=list(Study.warmups),
                        help="warm-up lengths of the grid, fractions of the updates")
    parser.add_argument("--optimizers", nargs="+", default=list(Study.optimizers),
                        help="--optimizer values every rule runs with")
    parser.add_argument("--seeds", type=int, default=Study.seeds, help="seeds per grid point")
    parser.add_argument("--rules", nargs="+", choices=[r.name for r in RULES],
                        default=list(STUDIED), help="the rules to run")
    parser.add_argument("--workers", type=int, default=1,
                        help="runs side by side, one process of one thread each")
    parser.add_argument("--quick", action="store_true",
                        help="a few iterations on a 2 x 2 grid (a smoke test of the whole path)")
    parser.add_argument("--json", default="docs/convergence.json",
                        help="the result; runs already in it (same setup) are kept, not rerun")
    parser.add_argument("--report-only", action="store_true",
                        help="no new runs: the table and the picture from the runs in --json")
    parser.add_argument("--plot", default="docs/images/convergence.png")
    args = parser.parse_args(argv)
    study = Study(data_dir=args.data_dir, iterations=args.iterations, lrs=tuple(args.lrs),
                  warmups=tuple(args.warmups), optimizers=tuple(args.optimizers),
                  seeds=args.seeds, rules=[r for r in RULES if r.name in args.rules])
    if args.quick:
        study = replace(study, iterations=4, warmups=(0.25, 0.5), lrs=(1e-3, 2e-3),
                        eval_interval=2, eval_sequences=4, seeds=2)
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
