#!/usr/bin/env bash
# Fine-tune a pretrained BERT checkpoint on each GLUE task and print the dev-set results.
# Every variable below can also be set from the environment, e.g. `TASKS="RTE MRPC" bash ...`.
# Data layout and metrics: docs/glue.md.
set -euo pipefail

: "${CHECKPOINT_DIR:=checkpoints/bert}" # --save directory of pretrain_bert.py
: "${GLUE_DIR:=data/glue}"              # one sub-directory per task: $GLUE_DIR/MNLI/train.tsv
: "${TASKS:=MNLI QQP QNLI SST-2 CoLA STS-B MRPC RTE WNLI}"
: "${TP:=1}"                            # tensor-parallel size = processes per task
: "${EPOCHS:=3}" "${LR:=2e-5}" "${MICRO_BATCH_SIZE:=32}" "${SEED:=1234}" "${SEQ_LENGTH:=128}"
# Default: the tokenizer and model shape recorded in the checkpoint. Set them to override, e.g.
# TOKENIZER_ARGS="--tokenizer-type BertWordPieceLowerCase --vocab-file data/bert-vocab.txt".
: "${TOKENIZER_ARGS:=}" "${MODEL_ARGS:=}"
: "${RESULTS_DIR:=results/glue}"
# Set to a directory to also write the GLUE server's test prediction files there (CoLA.tsv, ...);
# the MNLI run adds AX.tsv when $GLUE_DIR/diagnostic/diagnostic.tsv exists.
: "${TEST_PREDICTIONS:=}"
: "${PYTHON:=python}"

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"  # also without `pip install -e .`
mkdir -p "$RESULTS_DIR"

RESULT_FILES=()
for T in $TASKS; do
    echo "=== $T ==="
    # GLUE's diagnostic set is predicted with the MNLI model
    DIAGNOSTIC=""
    if [ -n "$TEST_PREDICTIONS" ] && [ "$T" = MNLI ] &&
       [ -f "$GLUE_DIR/diagnostic/diagnostic.tsv" ]; then
        DIAGNOSTIC="$GLUE_DIR/diagnostic/diagnostic.tsv"
    fi
    # Word splitting of TOKENIZER_ARGS / MODEL_ARGS into separate flags is intended.
    # shellcheck disable=SC2086
    torchrun --standalone --nproc-per-node "$TP" "$REPO_DIR/tools/finetune_glue.py" \
        --task "$T" \
        --data-dir "$GLUE_DIR/$T" \
        --load "$CHECKPOINT_DIR" \
        --results "$RESULTS_DIR/$T.json" \
        --epochs "$EPOCHS" \
        --lr "$LR" \
        --micro-batch-size "$MICRO_BATCH_SIZE" \
        --seed "$SEED" \
        --seq-length "$SEQ_LENGTH" \
        --tensor-model-parallel-size "$TP" \
        ${TEST_PREDICTIONS:+--test-predictions "$TEST_PREDICTIONS"} \
        ${DIAGNOSTIC:+--diagnostic-data "$DIAGNOSTIC"} \
        $TOKENIZER_ARGS $MODEL_ARGS
    RESULT_FILES+=("$RESULTS_DIR/$T.json")
done

"$PYTHON" -c 'import sys
from megatron_2bw.evaluation.glue import format_results_table
print(format_results_table(sys.argv[1:]))' "${RESULT_FILES[@]}"
