"""What the updater checks and reports at each step, through the real pipeline (gloo ranks):
- --check-for-nan-in-loss-and-grad (on by default): a non-finite gradient norm in fp32 stops every
  rank with an error naming the iteration, the rank and the stage (the check off, or fp16, skips
  the step instead: tests/pipeline/test_precision.py);
- --log-params-norm and --log-num-zeros-in-grad at t=2 x p=2 2BW: the norm of the weights after the
  step and the zero entries of the gradients it stepped with, each parameter counted once, equal
  to the same figures computed in one process from the reassembled model, and with the
  distributed optimizer (sharded weights and gradients) equal to the unsharded run's."""
import math

import pytest

from megatron_2bw.pipeline.executor import PipelineError
from megatron_2bw.training.segments import run_segment
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, gpt_feed, stage_on_rank, tiny_config
from tests.pipeline.precision_harness import precise_config, train_stage, with_changes


def inject_inf_on_the_last_stage(stage):
    if stage.layout.is_last_stage:
        stage.updater.overflow_injection = lambda batch: batch == 2


def failure_of_training(rank: int, world: int, config, batches: int) -> str | None:
    """The error that stopped this rank's training, if any (caught here, so that every rank
    reports its own, however the ranks race to fail)."""
    try:
        train_stage(rank, world, config, batches, inject_inf_on_the_last_stage)
    except PipelineError as error:
        return str(error)
    return None


def test_a_nonfinite_gradient_norm_stops_every_rank_naming_iteration_rank_and_stage():
    config = precise_config("fp32", p=2, schedule="2bw", optimizer="sgd", lr=0.5)
    assert config.training.check_for_nan_in_loss_and_grad  # Megatron-LM's default
    for rank, message in enumerate(run_ranks(2, failure_of_training, config, 4)):
        # every rank sees the same norm: each stops at the step of batch 2, naming itself
        assert message.startswith(f"stage {rank} failed at step(b2->v3): rank {rank}: the "
                                  f"gradient norm of iteration 3 is inf"), message
        assert "--no-check-for-nan-in-loss-and-grad" in message


def train_and_capture(rank: int, world: int, config, batches: int) -> dict:
    """Train; return this rank's master weights and the master gradients the last step used, in
    harness.full_weights' format, with the last step's reported figures."""
    results, stepped_grads = [], []
    layout, stage = stage_on_rank(rank, world, config, on_step=results.append)
    v, step = stage.versions, stage.optimizer.step

    def capturing_step():
        stepped_grads.append([m.grad.detach().clone() for m in v.master])
        step()
    stage.optimizer.step = capturing_step
    run_segment(stage, 0, batches, gpt_feed(config, layout))
    c = layout.coords
    return {"coords": (c.tp, c.dp, c.pp),
            "weights": {n: (m.detach().clone(), s) for n, m, s in zip(v.names, v.master, v.specs)},
            "grads": {n: (g, s) for n, g, s in zip(v.names, stepped_grads[-1], v.specs)},
            "reported": (results[-1].params_norm, results[-1].num_zeros_in_grad)}


def test_params_norm_and_zeros_in_grad_count_each_parameter_once():
    config = tiny_config(t=2, p=2, schedule="2bw", optimizer="adam", lr=0.01)
    config.logging.log_params_norm = config.logging.log_num_zeros_in_grad = True
    ranks = run_ranks(4, train_and_capture, config, 3)
    counted = lambda full: [t for name, t in full.items() if not name.startswith("tied_copy:")]
    weights = counted(full_weights(ranks))
    grads = counted(full_weights([{**r, "weights": r["grads"]} for r in ranks]))
    params_norm = math.sqrt(sum(float(w.double().square().sum()) for w in weights))
    zeros = sum(int((g == 0).sum()) for g in grads)
    assert zeros > 0  # the rows of the vocabulary's padding, counted once (not in the copy)
    for rank in ranks:  # the model's figures on every rank
        reported_norm, reported_zeros = rank["reported"]
        assert reported_norm == pytest.approx(params_norm, rel=1e-6)
        assert reported_zeros == zeros


def test_the_distributed_optimizer_reports_the_figures_of_the_unsharded_run():
    config = tiny_config(p=2, schedule="2bw", optimizer="adam", lr=0.01)  # d = 2 on 4 ranks
    config.logging.log_params_norm = config.logging.log_num_zeros_in_grad = True
    sharded = with_changes(config, parallel={"use_distributed_optimizer": True})
    plain, zero1 = ([r["reported"] for r in run_ranks(4, train_and_capture, c, 3)]
                    for c in (config, sharded))
    for (norm, zeros), (sharded_norm, sharded_zeros) in zip(plain, zero1):
        assert sharded_norm == pytest.approx(norm, rel=1e-6) and sharded_zeros == zeros > 0
