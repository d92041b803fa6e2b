"""--calculate-per-token-loss through the pipeline, against an independent reference that averages
the loss over all of a batch's tokens at once (model logits and torch's cross entropy): Flush and
GPipe reach vanilla training's weights, 2BW the delayed update's, over tensor, pipeline and data
parallelism; the logged loss is the batch's per-token mean, and validation weighs microbatches by
their tokens."""
import functools

import pytest
import torch
import torch.nn.functional as F

from megatron_2bw.data.gpt_dataset import DocumentBoundaries
from megatron_2bw.data.mock import MockGPTDataset
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.models import build_stage_model
from megatron_2bw.training.loop import evaluate
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import (full_weights, gpt_feed, max_difference, stage_on_rank,
                                    tiny_config, train_on_ranks)
from tests.pipeline.reference import delayed_update_reference

VOCAB = 101
EOD = VOCAB - 1
MICROBATCHES = 4  # of one process: global batch 8 = 4 x micro 2


class UnevenDocuments:
    """Mock samples whose first 0-6 inputs are end-of-document tokens, so --eod-mask-loss leaves
    the microbatches between 2 and 8 of their 8 targets each."""

    def __init__(self, seq_length: int):
        self.mock = MockGPTDataset(10_000, seq_length, VOCAB - 1, 7)

    def __len__(self) -> int:
        return len(self.mock)

    def __getitem__(self, index: int) -> dict:
        tokens = self.mock[index]["tokens"].copy()
        tokens[:(index * 5) % 7] = EOD
        return {"tokens": tokens}


def masked_feed(config, layout):
    return gpt_feed(config, layout, DocumentBoundaries(UnevenDocuments(config.model.seq_length),
                                                       EOD, loss_mask=True))


def config(per_token=True, optimizer="adam", **kwargs):
    """Adam with clipping; SGD without, so a gradient off by a constant factor shows."""
    c = tiny_config(optimizer=optimizer, **({"lr": 0.01, "clip": 0.5} if optimizer == "adam" else
                                            {"lr": 0.05, "clip": 0.0}), **kwargs)
    c.training.calculate_per_token_loss = per_token
    return c


def per_token_mean(model, microbatches: list[dict]) -> torch.Tensor:
    """Every counted target's loss, summed over the batch and divided by their number."""
    total, tokens = 0.0, 0.0
    for batch in microbatches:
        logits = model.logits(batch["tokens"][:, :-1])
        losses = F.cross_entropy(logits.flatten(0, 1), batch["tokens"][:, 1:].flatten(),
                                 reduction="none")
        mask = batch["loss_mask"].flatten()
        total, tokens = total + (losses * mask).sum(), tokens + mask.sum()
    return total / tokens


@functools.lru_cache(maxsize=None)
def reference(delayed: bool, batches: int, optimizer: str = "adam"):
    c = config(optimizer=optimizer)
    return delayed_update_reference(c, batches, masked_feed(c, ParallelLayout(1, 1, 1)),
                                    MICROBATCHES, per_token_mean, delayed=delayed)


@functools.lru_cache(maxsize=None)
def initial_loss(batch: int) -> float:
    """The per-token loss of a batch on the initial weights: what every schedule logs for batch
    0, and 2BW for batch 1 too (it runs on W(0))."""
    c = config()
    model = build_stage_model(c.model, None, 1, range(c.model.num_layers), True, True,
                              c.training.seed)
    feed = masked_feed(c, ParallelLayout(1, 1, 1))
    with torch.no_grad():
        return float(per_token_mean(model, [feed(batch * MICROBATCHES + j)
                                            for j in range(MICROBATCHES)]))


def logged_losses(results: list) -> list[float]:
    last = next(r["results"] for r in results if r["coords"] == (0, 0, 1))
    return [metrics["lm loss"] for _, _, _, metrics in last]


def test_the_reference_differs_from_the_mean_of_microbatch_means():
    # the data makes the flag matter: the default's loss takes another trajectory
    c = config(per_token=False)
    plain = delayed_update_reference(c, 3, masked_feed(c, ParallelLayout(1, 1, 1)), MICROBATCHES,
                                     delayed=False)
    assert max_difference(plain, reference(False, 3), VOCAB) > 1e-4


@pytest.mark.parametrize("schedule,optimizer", [("flush", "sgd"), ("gpipe", "adam")])
@pytest.mark.parametrize("t,p,world", [(2, 2, 4), (1, 2, 4)])
def test_flushed_schedules_match_vanilla_per_token_training(schedule, optimizer, t, p, world):
    results = run_ranks(world, train_on_ranks,
                        config(optimizer=optimizer, t=t, p=p, schedule=schedule), 3, masked_feed)
    assert max_difference(full_weights(results), reference(False, 3, optimizer), VOCAB) < 1e-5
    assert abs(logged_losses(results)[0] - initial_loss(0)) < 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("t,p,world", [(2, 2, 4), (1, 2, 4)])
def test_2bw_matches_the_delayed_per_token_update(optimizer, t, p, world):
    results = run_ranks(world, train_on_ranks,
                        config(optimizer=optimizer, t=t, p=p, schedule="2bw"), 4, masked_feed)
    assert max_difference(full_weights(results), reference(True, 4, optimizer), VOCAB) < 1e-5
    first, second = logged_losses(results)[:2]
    assert abs(first - initial_loss(0)) < 1e-5 and abs(second - initial_loss(1)) < 1e-5


class QuietLog:
    is_writer = False


def evaluate_on_rank(rank: int, world: int, per_token: bool):
    """Validation loss of the first batch at p2 x d2 (None on ranks without the loss)."""
    c = config(per_token=per_token, p=2, schedule="flush")
    c.training.eval_iters = 1
    layout, stage = stage_on_rank(rank, world, c)
    feed = masked_feed(c, layout)
    iterator = iter([feed(k) for k in range(stage.microbatches)])
    return evaluate(stage, iterator, QuietLog(), 0).get("lm loss")


def test_validation_weighs_microbatches_by_their_tokens():
    per_token = next(v for v in run_ranks(4, evaluate_on_rank, True) if v is not None)
    assert abs(per_token - initial_loss(0)) < 1e-5
    plain = next(v for v in run_ranks(4, evaluate_on_rank, False) if v is not None)
    assert abs(plain - per_token) > 1e-4

