"""Reshard a checkpoint to another tensor/pipeline-parallel layout: the model, both 2BW weight
versions, the optimizer state and the loss scale; the converted model computes the same loss.

    python tools/convert_checkpoint.py --load checkpoints/gpt --save checkpoints/gpt_t1p1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1

Converts the latest iteration (--iteration N for another); resume from the result with
--load checkpoints/gpt_t1p1 and the new sizes. Dropout RNG states belong to ranks of the old
layout and are not carried over: the resumed run reseeds them. The other pretraining flags (e.g.
--vocab-file for a tokenizer that moved) update the configuration stored with the checkpoint.
"""
from __future__ import annotations

import os
import sys

from megatron_2bw.arguments import ConfigError, build_parser
from megatron_2bw.checkpoint.reshard import check_layout_fits, read_full_state, write_full_state
from megatron_2bw.checkpoint.tool_config import config_with_base
from megatron_2bw.data.cli import exit_on_user_error
from megatron_2bw.pipeline.schedule_registry import REGISTRY

V_SCHEDULES = tuple(name for name, spec in REGISTRY.items() if spec.shape == "v")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("conversion")
    group.add_argument("--target-tensor-parallel-size", type=int, required=True)
    group.add_argument("--target-pipeline-parallel-size", type=int, required=True)
    group.add_argument("--target-virtual-pipeline-model-parallel-size", type=int, default=1,
                       help="model chunks per pipeline rank, for --pipeline-schedule interleaved "
                            "(default 1)")
    group.add_argument("--target-pipeline-schedule", choices=V_SCHEDULES, default=None,
                       help="write two model chunks per pipeline rank in a V for this schedule "
                            "(zb-v, dualpipev, v-half; default: one chunk, or the interleaved "
                            "chunks of --target-virtual-pipeline-model-parallel-size)")
    group.add_argument("--iteration", type=int, default=None,
                       help="iteration to convert (default: the latest)")


def main(argv=None) -> str:
    args = build_parser(__doc__.split("\n")[0], add_arguments).parse_args(argv)
    if not args.load or not args.save:
        raise ConfigError("--load SOURCE_DIR and --save TARGET_DIR are both required")
    if os.path.abspath(args.load) == os.path.abspath(args.save):
        raise ConfigError(f"--save {args.save} must differ from --load (the source stays intact)")
    state = read_full_state(args.load, args.iteration)
    state.config = config_with_base(args, state.config, f"checkpoint {args.load}")
    t, p = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    check_layout_fits(state.config.model, t, p, "--target-tensor-parallel-size",
                      "--target-pipeline-parallel-size")
    chunks, v_schedule = args.target_virtual_pipeline_model_parallel_size, \
        args.target_pipeline_schedule
    if v_schedule is not None and chunks != 1:
        raise ConfigError(f"--target-pipeline-schedule {v_schedule} places 2 model chunks per rank "
                          f"in a V; drop --target-virtual-pipeline-model-parallel-size {chunks}")
    write_full_state(state, args.save, t, p, chunks=chunks, v_schedule=v_schedule)
    print(f" converted {args.load} (iteration {state.iteration}) to t={t} x p={p} in {args.save}",
          flush=True)
    return args.save


if __name__ == "__main__":
    with exit_on_user_error(sys.argv[0]):
        main()
