"""Fine-tune a pretrained BERT checkpoint on a GLUE task and report its official dev metrics.

    torchrun --standalone --nproc-per-node 2 tools/finetune_glue.py --task MNLI \\
        --data-dir data/glue/MNLI --load checkpoints/bert --tensor-model-parallel-size 2 \\
        --epochs 3 --lr 2e-5 --micro-batch-size 32 --seq-length 128 --results results/MNLI.json \\
        --test-predictions results/glue_submission \\
        --diagnostic-data data/glue/diagnostic/diagnostic.tsv

Tasks: MNLI (dev matched and mismatched), QQP, QNLI, SST-2, CoLA, STS-B, MRPC, RTE, WNLI. The data
is a task directory of the GLUE distribution (--data-dir, .tsv files) or a local Hugging Face
`datasets` copy of the task (--datasets-dir). Flags are pretrain_bert.py's; model and tokenizer
flags left unset come from the checkpoint. With --test-predictions DIR the final model predicts the
task's test split(s) and writes the GLUE server's submission file(s) into DIR (MNLI-m.tsv and
MNLI-mm.tsv, else e.g. CoLA.tsv: "index<tab>prediction" rows); with --task MNLI, --diagnostic-data
adds GLUE's diagnostic set, AX.tsv. The test files are checked before training. Layout, results
and submission formats: docs/glue.md and docs/bert.md.
"""
from __future__ import annotations

import os
import sys

from megatron_2bw.arguments import ConfigError, build_parser, explicit_fields
from megatron_2bw.distributed.launch import exit_process
from megatron_2bw.evaluation.finetune import (DEFAULT_WARMUP_FRACTION, GlueSettings,
                                              finetune, finetune_config, open_pretrained)
from megatron_2bw.evaluation.glue import TASKS

PROGRAM = "finetune_glue.py"


def add_glue_args(parser) -> None:
    g = parser.add_argument_group("GLUE fine-tuning")
    g.add_argument("--task", required=True, help=f"one of {', '.join(TASKS)}")
    g.add_argument("--data-dir", help="the task's directory of the GLUE distribution (train.tsv, "
                                      "dev.tsv, ...)")
    g.add_argument("--datasets-dir", help="a local Hugging Face datasets copy of the task "
                                          "(save_to_disk directory or per-split parquet/jsonl)")
    g.add_argument("--results", help="write the per-epoch dev metrics to this JSON file")
    g.add_argument("--epochs", type=int, default=3)
    g.add_argument("--test-predictions", metavar="DIR",
                   help="after fine-tuning, predict the task's test split(s) and write the GLUE "
                        "server's submission file(s) into DIR (e.g. MNLI-m.tsv, MNLI-mm.tsv)")
    g.add_argument("--diagnostic-data", metavar="PATH",
                   help="with --task MNLI and --test-predictions: also predict GLUE's diagnostic "
                        "set into DIR/AX.tsv; PATH is the GLUE distribution's "
                        "diagnostic/diagnostic.tsv or a local datasets copy of the hub's ax config")


def settings_from_args(args) -> GlueSettings:
    # --lr-warmup-fraction (of all steps here) defaults to DEFAULT_WARMUP_FRACTION unless
    # --lr-warmup-iters is given; giving both is refused with the other flags' checks
    fraction = args.lr_warmup_fraction
    if fraction is None and ("optimizer", "lr_warmup_iters") not in explicit_fields(args):
        fraction = DEFAULT_WARMUP_FRACTION
    return GlueSettings(args.task, args.data_dir, args.datasets_dir, args.results, args.epochs,
                        fraction, args.test_predictions, args.diagnostic_data)


def main(argv=None) -> dict:
    args = build_parser(__doc__.split("\n")[0], add_glue_args).parse_args(argv)
    settings = settings_from_args(args)
    if args.load is None:
        raise ConfigError("--load DIR is required: the --save directory of pretrain_bert.py")
    pretrained = open_pretrained(args.load)
    return finetune(finetune_config(args, pretrained), settings, pretrained)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as error:  # ConfigError and bad data files included
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{PROGRAM}: error: {error}", file=sys.stderr, flush=True)
        exit_process(2)
    exit_process(0)
