"""How much slower one core computes while the other cores compute too.

    python benchmarks/core_contention.py --rounds 7

A pipeline of p stages on p cores can reach p times one core's throughput only if a core computes
as fast beside busy neighbours as alone. This measures that directly, without any communication:
one process bound to core 0 runs single-threaded kernels alone, then one such process per core
runs the same kernels at the same time. Three working sets separate the levels of the machine:
matmuls of side 128 (192 KiB: inside a core's own L2 cache) and 1024 (12 MiB: the shared L3), and
an elementwise add streaming three 64 MiB tensors through main memory. Each round measures every
kernel both ways back to back, alternating the order, so the machine's drift over minutes cancels
in the ratio; the table gives medians with the min-max over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from megatron_2bw.distributed.forked import run_forked  # noqa: E402
from megatron_2bw.distributed.launch import bind_cores, usable_cores  # noqa: E402


@dataclass(frozen=True)
class Kernel:
    """A matmul of two side x side matrices, or an elementwise add of two tensors of side x side
    elements (streamed through memory once side x side x 4 bytes exceeds the caches)."""
    kind: str  # "matmul" | "stream"
    side: int

    @property
    def working_set_bytes(self) -> int:
        return 3 * self.side * self.side * 4

    @property
    def work(self) -> float:
        """GFLOP for a matmul, GB moved for a stream (two read, one written)."""
        return (2 * self.side ** 3 if self.kind == "matmul" else self.working_set_bytes) / 1e9

    @property
    def unit(self) -> str:
        return "GFLOP/s" if self.kind == "matmul" else "GB/s"

    def label(self) -> str:
        return f"{self.kind} {self.side} ({self.working_set_bytes / 2 ** 20:.2f} MiB)"


def _repeat(rank: int, world: int, kernel: Kernel, count: int) -> float:
    bind_cores(rank, len(usable_cores()))  # rank r alone on core r
    a, b = torch.randn(kernel.side, kernel.side), torch.randn(kernel.side, kernel.side)
    out = torch.empty(kernel.side, kernel.side)
    op = torch.mm if kernel.kind == "matmul" else torch.add
    for _ in range(max(count // 10, 1)):  # warm caches and the allocator
        op(a, b, out=out)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(count):
        op(a, b, out=out)
    return time.perf_counter() - began


def run_on_cores(cores: int, kernel: Kernel, count: int) -> list[float]:
    """Seconds each of `cores` processes (each bound to its own core) took for `count` kernels."""
    return run_forked(cores, _repeat, kernel, count, timeout=600.0)


def repeats_for(kernel: Kernel, seconds: float) -> int:
    """How many kernels one core runs in about `seconds` (timed alone)."""
    count = 1
    while True:
        took = run_on_cores(1, kernel, count)[0]
        if took >= seconds / 4:
            return max(1, round(count * seconds / took))
        count *= 4


def measure(kernels: list[Kernel], cores: int, rounds: int, seconds: float) -> list[dict]:
    counts = {kernel: repeats_for(kernel, seconds) for kernel in kernels}
    samples: dict[Kernel, list[dict]] = {kernel: [] for kernel in kernels}
    for round_index in range(rounds):
        for kernel in kernels:
            timings = {}
            for together in ((False, True) if round_index % 2 == 0 else (True, False)):
                timings[together] = run_on_cores(cores if together else 1, kernel, counts[kernel])
            work = kernel.work * counts[kernel]
            alone, together = timings[False][0], statistics.mean(timings[True])
            sample = {"alone_rate": work / alone, "together_rate": work / together,
                      "slowdown": together / alone - 1}
            samples[kernel].append(sample)
            print(f"round {round_index + 1}, {kernel.label()}: alone {sample['alone_rate']:.1f} "
                  f"{kernel.unit}, on {cores} cores at once {sample['together_rate']:.1f} "
                  f"{kernel.unit} each ({sample['slowdown']:+.1%})", flush=True)
    return [{"kind": kernel.kind, "side": kernel.side, "unit": kernel.unit,
             "working_set_bytes": kernel.working_set_bytes, "repeats": counts[kernel],
             "rounds": samples[kernel],
             **{f"median_{key}": statistics.median(s[key] for s in samples[kernel])
                for key in ("alone_rate", "together_rate", "slowdown")}}
            for kernel in kernels]


def markdown(results: list[dict], cores: int) -> str:
    lines = [f"| kernel (working set) | alone | {cores} cores at once, each | slowdown (median) "
             f"| min-max |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        slowdowns = [s["slowdown"] for s in r["rounds"]]
        label = Kernel(r["kind"], r["side"]).label()
        lines.append(f"| {label} | {r['median_alone_rate']:.1f} {r['unit']} | "
                     f"{r['median_together_rate']:.1f} {r['unit']} | {r['median_slowdown']:+.1%} | "
                     f"{min(slowdowns):+.1%} to {max(slowdowns):+.1%} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", type=int, nargs="+", default=[128, 1024],
                        help="matmul sides (default: 128, inside L2; 1024, in the shared L3)")
    parser.add_argument("--stream-side", type=int, default=4096,
                        help="elementwise add of side x side tensors (default 4096: three 64 MiB "
                             "tensors, through main memory; 0: none)")
    parser.add_argument("--cores", type=int, default=None,
                        help="processes at once, one per core (default: every core)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="length of one timed run (default 1)")
    parser.add_argument("--json", default=None, help="write every round here")
    args = parser.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        parser.error("binding a process to a core needs os.sched_setaffinity (Linux)")
    available = len(usable_cores())
    args.cores = args.cores or available
    if not 2 <= args.cores <= available:
        parser.error(f"--cores must be between 2 and the {available} cores this process may use, "
                     f"got {args.cores}")
    if args.rounds < 1 or args.seconds <= 0 or min(args.sides) < 1 or args.stream_side < 0:
        parser.error("--rounds, --seconds and every --sides value must be positive, "
                     "--stream-side at least 0")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    kernels = [Kernel("matmul", side) for side in args.sides]
    if args.stream_side:
        kernels.append(Kernel("stream", args.stream_side))
    results = measure(kernels, args.cores, args.rounds, args.seconds)
    print(markdown(results, args.cores))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": args.cores, "rounds": args.rounds, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
