"""Mixed precision through the real pipeline: fp16 (loss scaling) and bf16 (fp32 gradient
accumulation) train the tiny GPT like fp32 under t=2 x p=2 2BW, and an fp16 overflow on one stage
skips that step on every stage, keeps both live versions valid and backs the scale off."""
import functools

import pytest
import torch

from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, max_difference
from tests.pipeline.precision_harness import precise_config, train_stage

VOCAB = 101


@functools.lru_cache(maxsize=None)
def t2_p2_2bw(precision: str) -> list[dict]:
    # SGD: a wrongly unscaled gradient would show (Adam would hide a constant factor)
    config = precise_config(precision, t=2, p=2, schedule="2bw", optimizer="sgd", lr=2.0)
    return run_ranks(4, train_stage, config, 12, None, True)


def last_stage(results: list[dict]) -> list[tuple]:
    return next(r["results"] for r in results if r["coords"] == (0, 0, 1))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_ends_within_2_percent_of_fp32(precision):
    reference, run = t2_p2_2bw("fp32"), t2_p2_2bw(precision)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    assert all(r["working_dtype"] == dtype for r in run)
    losses = [m["lm loss"] for _, _, _, _, m in last_stage(run)]
    fp32_losses = [m["lm loss"] for _, _, _, _, m in last_stage(reference)]
    assert fp32_losses[-1] < fp32_losses[0] - 0.2  # it learns
    assert abs(losses[-1] - fp32_losses[-1]) <= 0.02 * fp32_losses[-1]
    for step, fp32_step in zip(last_stage(run), last_stage(reference)):
        skipped, norm, fp32_norm = step[1], step[2], fp32_step[2]
        assert not skipped and abs(norm - fp32_norm) <= 0.05 * fp32_norm  # unscaled right
    assert max_difference(full_weights(run), full_weights(reference), VOCAB) < 0.05


def overflow_run(precision: str, inject_stage: int, drop_instead: bool = False) -> list[dict]:
    """p=2 2BW, 6 batches; batch 2's gradients overflow on one stage (or, for the reference, are
    zeroed on every stage: SGD without momentum and weight decay then leaves the weights alone)."""
    config = precise_config(precision, p=2, schedule="2bw", optimizer="sgd", lr=0.5)
    config.optimizer.weight_decay = 0.0
    config.precision.hysteresis = 1
    config.training.check_for_nan_in_loss_and_grad = False  # fp32: skip as fp16 does, not stop

    def before(stage):
        updater = stage.updater
        if drop_instead:
            reduce = updater.reduce

            def dropping_reduce(batch, microbatches):
                if batch == 2:
                    stage.versions.main_grad_buffer.zero_()
                reduce(batch, microbatches)
            updater.reduce = dropping_reduce
        elif stage.layout.stage == inject_stage:
            updater.overflow_injection = lambda batch: batch == 2
    return run_ranks(2, train_stage, config, 6, before)


def test_overflow_on_one_stage_skips_the_step_everywhere():
    skipped_run = overflow_run("fp32", inject_stage=1)
    dropped = overflow_run("fp32", inject_stage=1, drop_instead=True)
    for rank in skipped_run:
        assert [s for _, s, _, _, _ in rank["results"]] == [False, False, True, False, False, False]
        assert rank["distinct_versions"] <= 2
    # the batches after the skip ran on valid versions: the same weights as dropping the gradients
    assert max_difference(full_weights(skipped_run), full_weights(dropped), VOCAB) < 1e-6
    first, last = sorted(skipped_run, key=lambda r: r["coords"][2])
    assert torch.equal(first["weights"]["embedding.word_embeddings.weight"][0],
                       last["weights"]["output_embedding"][0])


def test_fp16_overflow_backs_the_scale_off_alike_on_every_stage():
    ranks = overflow_run("fp16", inject_stage=0)
    # batch b uses version b-1, made by step b-2: the backed-off scale first applies to batch 4
    expected_scales = [4096.0] * 4 + [2048.0] * 2
    for rank in ranks:
        assert [s for _, s, _, _, _ in rank["results"]] == [False, False, True, False, False, False]
        assert [scale for _, _, _, scale, _ in rank["results"]] == expected_scales
    stage0, stage1 = (r["results"] for r in sorted(ranks, key=lambda r: r["coords"][2]))
    for a, b in zip(stage0, stage1):  # one global norm, unscaled alike on both stages
        assert a[2] == b[2] or (a[1] and b[1])
    losses = [m["lm loss"] for *_, m in stage1]
    assert all(torch.isfinite(torch.tensor(losses)))
