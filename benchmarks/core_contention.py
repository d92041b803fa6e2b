"""How much slower one core computes while the other cores compute too.

    python benchmarks/core_contention.py --rounds 5

A pipeline of p stages on p cores can reach p times one core's throughput only if a core computes
as fast beside busy neighbours as alone. This measures that directly, without any communication:
one process bound to core 0 runs single-threaded matmuls alone, then one such process per core
runs the same matmuls at the same time. Matrix sides 128 (three matrices in 192 KiB: inside a
core's own L2 cache) and 1024 (12 MiB: the shared L3) separate a slowdown of the shared memory
system from one of the cores themselves (on a virtual machine: the host's scheduling and clock).
Each round measures every size both ways back to back, alternating the order, so the machine's
drift over minutes cancels in the ratio; the table gives medians with the min-max over rounds.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time

import torch


def _matmuls(core: int, side: int, count: int, start, results) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    a, b = torch.randn(side, side), torch.randn(side, side)
    out = torch.empty(side, side)
    for _ in range(max(count // 10, 1)):  # warm caches and the allocator
        torch.mm(a, b, out=out)
    start.wait()
    began = time.perf_counter()
    for _ in range(count):
        torch.mm(a, b, out=out)
    results.put(time.perf_counter() - began)


def run_on_cores(cores: int, side: int, count: int) -> list[float]:
    """Seconds each of `cores` processes (each bound to its own core) took for `count` matmuls."""
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(cores), context.Queue()
    workers = [context.Process(target=_matmuls, args=(core, side, count, start, results))
               for core in sorted(os.sched_getaffinity(0))[:cores]]
    for worker in workers:
        worker.start()
    seconds = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
        if worker.exitcode:
            raise RuntimeError(f"a matmul process on {cores} cores exited with {worker.exitcode}")
    return seconds


def matmuls_for(side: int, seconds: float) -> int:
    """How many matmuls of this side one core does in about `seconds` (timed alone)."""
    count = 1
    while True:
        took = run_on_cores(1, side, count)[0]
        if took >= seconds / 4:
            return max(1, round(count * seconds / took))
        count *= 4


def measure(sides: list[int], cores: int, rounds: int, seconds: float) -> list[dict]:
    counts = {side: matmuls_for(side, seconds) for side in sides}
    samples = {side: [] for side in sides}
    for round_index in range(rounds):
        for side in sides:
            alone_first = round_index % 2 == 0
            timings = {}
            for together in ((False, True) if alone_first else (True, False)):
                timings[together] = run_on_cores(cores if together else 1, side, counts[side])
            flops = 2 * side ** 3 * counts[side]
            samples[side].append({"alone_gflops": flops / timings[False][0] / 1e9,
                                  "together_gflops": flops / statistics.mean(timings[True]) / 1e9,
                                  "slowdown": statistics.mean(timings[True]) / timings[False][0] - 1})
            print(f"round {round_index + 1}, side {side}: alone {samples[side][-1]['alone_gflops']:.0f} "
                  f"GFLOP/s, on {cores} cores at once {samples[side][-1]['together_gflops']:.0f} "
                  f"GFLOP/s each ({samples[side][-1]['slowdown']:+.1%})", flush=True)
    return [{"side": side, "working_set_bytes": 3 * side * side * 4, "matmuls": counts[side],
             "rounds": samples[side],
             **{f"median_{key}": statistics.median(s[key] for s in samples[side])
                for key in ("alone_gflops", "together_gflops", "slowdown")}}
            for side in sides]


def markdown(results: list[dict], cores: int) -> str:
    lines = [f"| matrix side (working set) | alone, GFLOP/s | {cores} cores at once, GFLOP/s each "
             f"| slowdown (median) | min-max |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        slowdowns = [s["slowdown"] for s in r["rounds"]]
        lines.append(f"| {r['side']} ({r['working_set_bytes'] / 2 ** 20:.2f} MiB) | "
                     f"{r['median_alone_gflops']:.0f} | {r['median_together_gflops']:.0f} | "
                     f"{r['median_slowdown']:+.1%} | {min(slowdowns):+.1%} to {max(slowdowns):+.1%} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", type=int, nargs="+", default=[128, 1024],
                        help="matrix sides (default: 128, inside L2; 1024, in the shared L3)")
    parser.add_argument("--cores", type=int, default=None,
                        help="processes at once, one per core (default: every core)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="length of one timed run (default 1)")
    parser.add_argument("--json", default=None, help="write every round here")
    args = parser.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        parser.error("binding a process to a core needs os.sched_setaffinity (Linux)")
    available = len(os.sched_getaffinity(0))
    args.cores = args.cores or available
    if not 2 <= args.cores <= available:
        parser.error(f"--cores must be between 2 and the {available} cores this process may use, "
                     f"got {args.cores}")
    if args.rounds < 1 or args.seconds <= 0 or min(args.sides) < 1:
        parser.error("--rounds, --seconds and every --sides value must be positive")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    results = measure(args.sides, args.cores, args.rounds, args.seconds)
    print(markdown(results, args.cores))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": args.cores, "rounds": args.rounds, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
