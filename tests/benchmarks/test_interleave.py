from tests.benchmarks import load_benchmark

interleave = load_benchmark("interleave")


def test_each_round_runs_every_configuration_once_in_its_own_repeatable_order():
    orders = [interleave.round_order(34, r) for r in range(5)]
    assert all(sorted(order) == list(range(34)) for order in orders)
    assert len({tuple(order) for order in orders}) == 5  # no two rounds alike
    assert len({order[0] for order in orders}) > 1  # not always the same one first in a round
    assert orders == [interleave.round_order(34, r) for r in range(5)]  # a rerun repeats it
