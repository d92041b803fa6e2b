"""Train the tiny GPT/BERT through the real stage machinery on gloo ranks, and reassemble weights."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.config_checks import validate_for_world
from megatron_2bw.config import Config, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megatron_2bw.data.mock import MockGPTDataset
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.training.segments import run_segment
from megatron_2bw.training.stage import build_stage


def tiny_config(t=1, p=1, schedule=None, global_batch=8, micro=2, optimizer="sgd", layers=4,
                lr=0.05, clip=0.0, **model_overrides) -> Config:
    model = dict(num_layers=layers, hidden_size=32, num_attention_heads=4, seq_length=8,
                 vocab_size=101, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                 attention_dropout=0.0)
    model.update(model_overrides)
    return Config(
        model=ModelConfig(**model),
        parallel=ParallelConfig(tensor_parallel=t, pipeline_parallel=p, schedule=schedule),
        # adam_eps 1e-4: the key bias has a mathematically zero gradient whose float noise Adam
        # would blow up to +-lr per step, masking real differences between layouts
        optimizer=OptimizerConfig(optimizer=optimizer, lr=lr, clip_grad=clip, weight_decay=0.01,
                                  lr_decay_style="constant", sgd_momentum=0.0, adam_eps=1e-4),
        training=TrainingConfig(micro_batch_size=micro, global_batch_size=global_batch,
                                train_iters=100, seed=1234))


def microbatch_samples(k: int, m: int, micro: int, d: int, dp_rank: int, global_batch: int):
    """Megatron's order: within batch b, microbatch j of dp rank r reads samples
    b*G + j*micro*d + r*micro ... + micro."""
    b, j = divmod(k, m)
    start = b * global_batch + j * micro * d + dp_rank * micro
    return range(start, start + micro)


def gpt_feed(config: Config, layout: ParallelLayout, dataset=None):
    tr = config.training
    m = tr.global_batch_size // (tr.micro_batch_size * layout.data_replicas)
    dataset = dataset or MockGPTDataset(10_000, config.model.seq_length, config.model.vocab_size, 7)

    def feed(k: int) -> dict:
        idx = microbatch_samples(k, m, tr.micro_batch_size, layout.data_replicas,
                                 layout.sample_rank, tr.global_batch_size)
        samples = [dataset[i] for i in idx]
        return {key: torch.stack([torch.from_numpy(s[key]) for s in samples]) for key in samples[0]}
    return feed


def stage_on_rank(rank: int, world: int, config: Config, on_step=None):
    """This rank's layout (groups built) and CPU stage of `config`."""
    validate_for_world(config, world)
    par = config.parallel
    layout = ParallelLayout(world, par.tensor_parallel, par.pipeline_parallel, rank,
                            par.context_parallel)
    layout.build_groups(1.0)
    return layout, build_stage(config, layout, torch.device("cpu"), None, on_step=on_step)


def train_on_ranks(rank: int, world: int, config: Config, batches: int, feed_factory=gpt_feed,
                   before=None):
    """Run `batches` batches; return this rank's master weights (dp 0 only), step results and
    coordinates."""
    results = []
    layout, stage = stage_on_rank(rank, world, config, on_step=results.append)
    if before is not None:
        before(stage)
    run_segment(stage, 0, batches, feed_factory(config, layout))
    return {**rank_weights(layout, stage),
            "results": [(r.batch, r.skipped, r.grad_norm, r.metrics) for r in results]}


def evaluate_on_ranks(rank: int, world: int, config: Config, microbatches: int = 4) -> dict:
    """Forward-only over `microbatches` microbatches: this rank's loss sums and their weight."""
    layout, stage = stage_on_rank(rank, world, config)
    sums, weight = stage.executor.evaluate(microbatches, gpt_feed(config, layout))
    return {"sums": sums, "weight": weight}


def rank_weights(layout: ParallelLayout, stage) -> dict:
    """This rank's coordinates and master weights with their specs, as full_weights takes them."""
    c = layout.coords
    weights = {n: (m.detach().clone(), m.spec if hasattr(m, "spec") else spec)
               for n, m, spec in zip(stage.versions.names, stage.versions.master, stage.versions.specs)}
    return {"coords": (c.tp, c.dp, c.pp), "weights": weights}


def full_weights(rank_results: list) -> dict[str, torch.Tensor]:
    """Reassemble unsharded weights from data-parallel rank 0 of every (tp, pp)."""
    shards: dict[str, list] = {}
    for result in rank_results:
        tp, dp, pp = result["coords"]
        if dp != 0:
            continue
        for name, (tensor, spec) in result["weights"].items():
            if spec.tied_copy:
                name = "tied_copy:" + name
            shards.setdefault(name, []).append((tp, tensor, spec))
    full = {}
    for name, parts in shards.items():
        parts.sort(key=lambda x: x[0])
        spec = parts[0][2]
        full[name] = parts[0][1] if spec.partition_dim is None else torch.cat(
            [t for _, t, _ in parts], dim=spec.partition_dim)
    return full


def max_difference(a: dict, b: dict, vocab_size: int, skip_prefix="tied_copy:") -> float:
    """Largest difference over all weights; vocabulary-sized tensors are compared on the true
    vocabulary (the padding depends on t)."""
    keys = [k for k in a if not k.startswith(skip_prefix)]
    assert set(keys) == {k for k in b if not k.startswith(skip_prefix)}, (sorted(keys), sorted(b))
    worst = 0.0
    for k in keys:
        x, y = a[k], b[k]
        if x.shape != y.shape:
            x, y = x[:vocab_size], y[:vocab_size]
        worst = max(worst, (x - y).abs().max().item())
    return worst


def barrier():
    if dist.is_initialized():
        dist.barrier()
