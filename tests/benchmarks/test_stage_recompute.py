"""benchmarks/stage_recompute.py's setup: under its memory budget no recomputation does not fit,
the planner's per-stage plan fits while recomputing fewer layers than any uniform plan that fits."""
from benchmarks.stage_recompute import bench_config, estimates, parse_args, plans


def test_the_budget_separates_the_plans():
    args = parse_args(["--hidden-size", "64", "--seq-length", "64"])
    budget, to_run = plans(args)
    fits = {name: all(e <= budget for e in estimates(bench_config(args, plan)))
            for name, plan in to_run.items()}
    assert fits == {"planner": True, "uniform": True, "full": True, "none": False}
    planner, uniform = to_run["planner"], to_run["uniform"]
    assert planner[0] == uniform[0] > 0 and planner[1] < uniform[1]
    assert sum(planner) < sum(uniform) < sum(to_run["full"])
