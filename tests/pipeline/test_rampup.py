"""--rampup-batch-size through the pipeline: the training loop's pieces (one sampler over the whole
run, a segment per batch size, m set per segment) against an independent single-process loop that
takes each batch's samples whole: Flush at p2 x d2 reaches vanilla training's weights, 2BW at
t2 x p2 the delayed update's, across the drains where the batch grows. And pretrain() itself logs
each iteration's batch and resumes inside the ramp bit for bit."""
import json
from pathlib import Path

import pytest
import torch

from megatron_2bw.config_checks import validate_for_world
from megatron_2bw.batch_schedule import batch_schedule
from megatron_2bw.data.mock import MockGPTDataset
from megatron_2bw.data.samplers import build_data_iterator
from megatron_2bw.training.loop import pretrain
from megatron_2bw.training.segments import (MicrobatchFeed, microbatches_of, run_segment,
                                            segment_ends)
from tests.checkpoint.helpers import config_from_flags, logged_losses, pretrain_flags
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import (full_weights, max_difference, rank_weights, stage_on_rank,
                                    tiny_config)
from tests.pipeline.reference import delayed_update_reference

VOCAB = 101
RAMP = [4, 2, 12]  # to 8: batches 4, 4, 6, 8, 8, 8 (iterations_for_samples(38) = 6)
STEPS = [[0, 4], [8, 6], [14, 8]]  # the same batches as --step-batch-size-schedule (samples)


def config(optimizer: str, steps: bool = False, **kwargs):
    c = tiny_config(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 0.01, clip=0.5,
                    global_batch=8, micro=kwargs.pop("micro", 2), **kwargs)
    if steps:
        c.training.step_batch_size_schedule = STEPS
    else:
        c.training.rampup_batch_size = RAMP
    c.training.train_samples = 38
    return c


def dataset(c):
    return MockGPTDataset(10_000, c.model.seq_length, c.model.vocab_size, 7)


def train_like_pretrain(rank: int, world: int, c):
    """pretrain()'s loop without its logging, data files and checkpoints."""
    results = []
    layout, stage = stage_on_rank(rank, world, c, on_step=results.append)
    iterator = build_data_iterator(dataset(c), 0, c.training.micro_batch_size, layout.sample_rank,
                                   layout.data_replicas)
    segments = []
    for end in segment_ends(c, stage.iteration):
        m = microbatches_of(stage, stage.iteration)
        run_segment(stage, stage.iteration, end - stage.iteration,
                    MicrobatchFeed(iterator, torch.device("cpu"), stage.iteration * m))
        segments.append((stage.iteration, end, m))
        stage.iteration = end
    return {**rank_weights(layout, stage), "segments": segments,
            "steps": [r.batch for r in results]}


def whole_batches(c):
    """Batch b as one microbatch of its samples consumed(b) .. consumed(b + 1) - 1: with equal
    token counts its mean loss is the mean of the pipeline's microbatch means."""
    schedule, data = batch_schedule(c.training), dataset(c)

    def feed(b: int) -> dict:
        samples = [data[i]["tokens"] for i in range(schedule.consumed(b), schedule.consumed(b + 1))]
        return {"tokens": torch.stack([torch.from_numpy(s) for s in samples])}
    return feed


@pytest.mark.parametrize("steps", [False, True], ids=["rampup", "step-schedule"])
@pytest.mark.parametrize("schedule,optimizer,t,p,world,micro", [
    ("flush", "sgd", 1, 2, 4, 1),  # p2 x d2: batches 4, 4, 6, 8 are m = 2, 2, 3, 4 per replica
    ("2bw", "adam", 2, 2, 4, 2),  # t2 x p2: m = 2, 2, 3, 4
])
def test_a_ramp_through_the_pipeline_matches_one_process(schedule, optimizer, t, p, world, micro,
                                                         steps):
    c = config(optimizer, steps, t=t, p=p, schedule=schedule, micro=micro)
    validate_for_world(c, world)  # --train-samples 38: 6 iterations
    assert c.training.train_iters == 6
    results = run_ranks(world, train_like_pretrain, c)
    reference = delayed_update_reference(config(optimizer), 6, whole_batches(c), 1,
                                         delayed=schedule == "2bw")
    assert max_difference(full_weights(results), reference, VOCAB) < 1e-5
    d = world // (t * p)
    assert results[0]["segments"] == [(0, 2, 4 // (micro * d)), (2, 3, 6 // (micro * d)),
                                      (3, 6, 8 // (micro * d))]
    assert results[0]["steps"] == list(range(6))


def ramp_flags(*extra) -> list[str]:
    """The checkpoint tests' tiny GPT (dropout on) on p = 2 under 2BW, counted in samples: 38
    samples are batches of 4, 4, 6, 8, 8, 8."""
    flags = pretrain_flags(1, 2, 1)
    for flag in ("--train-iters", "--lr-warmup-iters"):
        del flags[flags.index(flag):flags.index(flag) + 2]
    return [*flags, "--train-samples", "38", "--lr-warmup-samples", "8", "--rampup-batch-size",
            *map(str, RAMP), *extra]


def interrupted_ramp(rank: int, world: int, root: Path) -> dict:
    """pretrain() straight through the ramp; then stopped at iteration 2 (--exit-interval: inside
    the ramp, before the batch grows) and resumed from its checkpoint."""
    ckpt = str(root / "checkpoints")
    straight = pretrain(config_from_flags(ramp_flags("--log-file", str(root / "straight.jsonl"))))
    pretrain(config_from_flags(ramp_flags("--log-file", str(root / "first.jsonl"), "--save", ckpt,
                                          "--exit-interval", "2")))
    resumed = pretrain(config_from_flags(ramp_flags("--log-file", str(root / "second.jsonl"),
                                                    "--save", ckpt, "--load", ckpt)))
    return {name: (a.detach().clone(), b.detach().clone()) for name, a, b in
            zip(straight.versions.names, straight.versions.master, resumed.versions.master)}


def test_pretrain_logs_the_ramp_and_resumes_inside_it_exactly(tmp_path):
    ranks = run_ranks(2, interrupted_ramp, tmp_path, timeout=300)
    records = [json.loads(line) for line in open(tmp_path / "straight.jsonl")]
    logged = [(r["iteration"], r["global-batch-size"], r["consumed-samples"]) for r in records
              if "consumed-samples" in r]
    assert logged == [(1, 4, 4), (2, 4, 8), (3, 6, 14), (4, 8, 22), (5, 8, 30), (6, 8, 38)]
    first, second = logged_losses(tmp_path / "first.jsonl"), logged_losses(tmp_path / "second.jsonl")
    assert [i for i, _ in second] == [3, 4, 5, 6]
    assert first + second == logged_losses(tmp_path / "straight.jsonl")  # bit for bit
    for weights in ranks:
        assert all(torch.equal(a, b) for a, b in weights.values())
