"""What a blocking all-reduce costs right after the ranks computed, against back to back.

    python benchmarks/collective_after_compute.py --world-size 2 --json after_compute.json

The planner's hardware probe (`detect_hardware`) times all-reduces back to back, as a library
benchmark does. Training calls them between stretches of compute: tensor parallelism meets after
every few milliseconds of a layer's matmuls. Here every rank busy-waits on the clock for a segment
of S ms (the same S on every rank) and then all-reduces; the extra cost of one all-reduce is
(its time after the segment) - (its time back to back). Segment lengths and the back-to-back
case are interleaved over rounds; the table gives the mean and the median over all calls and
ranks (the mean is what a run pays; on this VM the times have a heavy tail).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from megatron_2bw.distributed.forked import run_forked  # noqa: E402
from megatron_2bw.planner.hardware import busy_wait  # noqa: E402


def _measure(rank: int, world: int, nbytes: int, segments_s: list[float], calls: int,
             rounds: int) -> dict[float, list[float]]:
    """Per segment length (0: back to back), the seconds of each all-reduce on this rank."""
    tensor = torch.zeros(max(1, nbytes // 4))
    for _ in range(5):
        dist.all_reduce(tensor)
    times: dict[float, list[float]] = {s: [] for s in segments_s}
    for _ in range(rounds):
        for segment in segments_s:
            dist.barrier()
            for _ in range(calls):
                busy_wait(segment)
                start = time.perf_counter()
                dist.all_reduce(tensor)
                times[segment].append(time.perf_counter() - start)
    return times


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--segments-ms", type=float, nargs="+", default=[0.5, 1, 2, 5],
                        help="compute segments before each all-reduce (back to back is added)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 262144],
                        help="all-reduce sizes in bytes")
    parser.add_argument("--calls", type=int, default=30, help="all-reduces per segment and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.calls < 1 or args.rounds < 1 or min(args.sizes) < 1 \
            or min(args.segments_ms) <= 0:
        parser.error("--world-size must be at least 2; --calls, --rounds, --sizes and "
                     "--segments-ms must be positive")
    segments = [0.0] + [ms / 1000 for ms in args.segments_ms]
    rows = []
    print(f"{args.world_size} ranks, {args.calls} all-reduces per segment, {args.rounds} rounds")
    print(f"{'bytes':>8} {'segment ms':>10} {'mean ms':>8} {'median ms':>9} {'extra mean ms':>13} "
          f"{'extra median ms':>15}")
    for nbytes in args.sizes:
        per_rank = run_forked(args.world_size, _measure, nbytes, segments, args.calls,
                              args.rounds, timeout=600.0)
        pooled = {s: [t for rank in per_rank for t in rank[s]] for s in segments}
        base_mean, base_median = statistics.mean(pooled[0.0]), statistics.median(pooled[0.0])
        for segment in segments:
            mean, median = statistics.mean(pooled[segment]), statistics.median(pooled[segment])
            rows.append({"bytes": nbytes, "segment_s": segment, "mean_s": mean,
                         "median_s": median, "extra_mean_s": mean - base_mean,
                         "extra_median_s": median - base_median})
            print(f"{nbytes:>8} {segment * 1e3:>10.1f} {mean * 1e3:>8.2f} {median * 1e3:>9.2f} "
                  f"{(mean - base_mean) * 1e3:>13.2f} {(median - base_median) * 1e3:>15.2f}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"world_size": args.world_size, "rows": rows},
                                              indent=1))
    return rows


if __name__ == "__main__":
    main()
