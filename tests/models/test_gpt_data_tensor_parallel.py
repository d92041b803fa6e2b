"""GPT with t=2 x d=2 (4 processes) gives the loss, gradient norm and weights of one process on the
same global batch (dropout 0), step after step."""
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import full_weights, max_difference, tiny_config, train_on_ranks


def test_t2_d2_matches_one_process():
    single = run_ranks(1, train_on_ranks, tiny_config(optimizer="adam", lr=0.01), 4)
    parallel = run_ranks(4, train_on_ranks, tiny_config(t=2, optimizer="adam", lr=0.01), 4)
    for result in parallel:
        for (b1, _, norm1, m1), (b2, _, norm2, m2) in zip(single[0]["results"], result["results"]):
            assert abs(norm1 - norm2) < 1e-5 * max(1.0, norm1)
            assert abs(m1["lm loss"] - m2["lm loss"]) < 1e-5
    assert max_difference(full_weights(parallel), full_weights(single), 101) < 1e-5
