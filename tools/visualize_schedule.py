"""Draw a pipeline schedule (stage by time) from the action lists the runtime executes.

    python tools/visualize_schedule.py --schedule 2bw --pipeline-stages 4 --microbatches 4 \\
        --batches 3 --output schedule.png
    python tools/visualize_schedule.py --compare 2bw,flush,gpipe --output compare.png
    python tools/visualize_schedule.py --compare 2bw,pipedream,flush --output versions.png
    python tools/visualize_schedule.py --compare pipedream,pipemare --microbatches 1 --batches 5 \\
        --output backward_versions.png
    python tools/visualize_schedule.py --schedule 2bw --text
    python tools/visualize_schedule.py --compare flush,zb-h1,interleaved --microbatches 8 \
        --batches 1 --virtual-pipeline-model-parallel-size 2 --output vanilla.png

Boxes are coloured by weight version (forward solid, backward light and hatched) and numbered by
microbatch; a black tick marks the step that creates a version; grey is idle time (the bubble).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_2bw.pipeline import schedules
from megatron_2bw.pipeline.visualize import ScheduleShape, plot_schedules


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="visualize_schedule.py", description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", choices=schedules.SCHEDULES, default="2bw",
                        help="the --pipeline-schedule to draw (default 2bw)")
    parser.add_argument("--compare", metavar="LIST",
                        help="comma-separated schedules drawn one above the other on one time axis, "
                             "e.g. 2bw,flush,gpipe (overrides --schedule)")
    parser.add_argument("--pipeline-stages", type=int, default=4, help="p (default 4)")
    parser.add_argument("--microbatches", type=int, default=4, help="m per batch (default 4)")
    parser.add_argument("--batches", type=int, default=3, help="batches (iterations) to draw")
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=2,
                        dest="chunks", help="interleaved: model chunks per stage (default 2)")
    parser.add_argument("--forward-time", type=float, default=1.0, help="units per forward")
    parser.add_argument("--backward-time", type=float, default=2.0, help="units per backward")
    parser.add_argument("--output", help="PNG file to write")
    parser.add_argument("--text", action="store_true", help="print the terminal rendering")
    return parser


def fail(message: str) -> None:
    print(f"visualize_schedule.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def schedule_names(args) -> list[str]:
    if not args.compare:
        return [args.schedule]
    names = [name.strip() for name in args.compare.split(",") if name.strip()]
    unknown = [name for name in names if name not in schedules.SCHEDULES]
    if unknown or not names:
        fail(f"--compare expects a comma-separated list of {','.join(schedules.SCHEDULES)}, "
                     f"got {args.compare!r}")
    return names


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.output and not args.text:
        fail("nothing to do: give --output FILE.png and/or --text")
    for flag in ("pipeline_stages", "microbatches", "batches"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be a positive integer, "
                         f"got {getattr(args, flag)}")
    if args.forward_time <= 0 or args.backward_time <= 0:
        fail("--forward-time and --backward-time must be positive")
    if args.chunks < 2:
        fail(f"--virtual-pipeline-model-parallel-size must be at least 2, got {args.chunks}")
    shapes = [ScheduleShape(name, args.pipeline_stages, args.microbatches, args.batches,
                            schedules.REGISTRY[name].chunks or args.chunks)
              for name in schedule_names(args)]
    try:
        lists = [schedules.build_schedule(s.schedule, s.stages, s.microbatches, s.batches, 0,
                                          s.chunks) for s in shapes]
    except ValueError as error:  # e.g. 1F1B schedules need m >= p
        fail(f"--pipeline-stages {args.pipeline_stages} --microbatches {args.microbatches}: {error}")
    if args.text:
        for shape, actions in zip(shapes, lists):
            print(shape.title())
            print(schedules.render(actions, shape=schedules.REGISTRY[shape.schedule].shape))
    if args.output:
        output = Path(args.output)
        if not output.parent.is_dir():
            fail(f"--output {args.output}: directory {output.parent} does not exist")
        plot_schedules(shapes, str(output), args.forward_time, args.backward_time)
        print(f"wrote {output}")


if __name__ == "__main__":
    main()
