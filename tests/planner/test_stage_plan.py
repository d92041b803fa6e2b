"""The joint split and per-stage recompute search against brute force over every split."""
import itertools
import random

import pytest

from megatron_2bw.planner.stage_plan import LayerCosts, evaluate_plan, plan_stages


def compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def brute_force(costs, stages, fewest):
    best = None
    for split in compositions(costs.layers, stages):
        plan = [fewest(s, n) for s, n in enumerate(split)]
        if None in plan:
            continue
        candidate = evaluate_plan(costs, split, plan)
        if best is None or candidate.bottleneck_s < best.bottleneck_s - 1e-12:
            best = candidate
    return best


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force_on_uneven_layers_and_memory(seed):
    rng = random.Random(seed)
    layers, stages = rng.randint(4, 9), rng.randint(2, 4)
    forward = tuple(rng.uniform(0.5, 3.0) for _ in range(layers))
    costs = LayerCosts(forward, tuple(2 * f for f in forward), forward,
                       rng.uniform(0, 2), rng.uniform(0, 4))
    capacity = [rng.randint(1, 4) for _ in range(stages)]  # layers a stage stashes in memory

    def fewest(stage, count):  # recomputed layers stash ~nothing; at most 2 of them fit besides
        k = max(0, count - capacity[stage])
        return k if k <= 2 else None
    plan, expected = plan_stages(costs, stages, fewest), brute_force(costs, stages, fewest)
    if expected is None:
        assert plan is None
        return
    assert plan.bottleneck_s == pytest.approx(expected.bottleneck_s)
    assert sum(plan.split) == layers and min(plan.split) >= 1
    assert plan.recompute == tuple(fewest(s, n) for s, n in enumerate(plan.split))


def test_later_stages_take_the_extra_layers_and_recompute_only_where_needed():
    costs = LayerCosts.uniform(8, 1.0, 2.0, 1.0)
    assert plan_stages(costs, 4).split == (2, 2, 2, 2)
    assert plan_stages(LayerCosts.uniform(9, 1.0, 2.0, 1.0), 4).split == (1, 2, 3, 3)
    # stage 0 holds 4 microbatches in flight: it fits 1 stashed layer, the others more
    plan = plan_stages(costs, 4, lambda stage, count: max(0, count - (1 if stage == 0 else 4)))
    assert plan.split == (2, 2, 2, 2) and plan.recompute == (1, 0, 0, 0)
    # a heavy layer 0 moves the boundary
    heavy = LayerCosts((5.0,) + (1.0,) * 7, (10.0,) + (2.0,) * 7, (5.0,) + (1.0,) * 7)
    assert plan_stages(heavy, 2).split == (2, 6)  # 15 + 3 against 6 x 3


def test_a_pinned_split_is_planned_where_it_fits():
    """memory_bound(pinned_split=...) answers only the pinned counts (None elsewhere): the search
    must still find that split and its recompute plan, also when another split would be faster."""
    pinned = (3, 5)

    def fewest(stage, count):
        return max(0, count - 2) if count == pinned[stage] else None
    plan = plan_stages(LayerCosts.uniform(8, 1.0, 2.0, 1.0), 2, fewest)
    assert plan is not None and plan.split == pinned and plan.recompute == (1, 3)
