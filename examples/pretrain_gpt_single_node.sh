#!/usr/bin/env bash
# Pretrain GPT on one machine with torchrun (one process per GPU; on a CPU-only machine one gloo
# process per GPUS_PER_NODE). Smoke test on a laptop:
#
#   GPUS_PER_NODE=2 TP=1 PP=2 NUM_LAYERS=2 HIDDEN_SIZE=64 NUM_ATTENTION_HEADS=4 SEQ_LENGTH=64 \
#   MICRO_BATCH_SIZE=2 GLOBAL_BATCH_SIZE=8 TRAIN_ITERS=20 LR_WARMUP_ITERS=2 PRECISION=fp32 \
#   bash examples/pretrain_gpt_single_node.sh --vocab-size 512
#
# Every variable below can be set in the environment. Extra arguments go to pretrain_gpt.py after
# the ones set here, so they win (the last occurrence of a flag counts): e.g. `--fp16`,
# `--wandb-project NAME`, `--log-file run.jsonl`, `--recompute-activations`.
set -euo pipefail

: "${GPUS_PER_NODE:=8}"                 # processes, one per GPU
: "${TP:=2}"                            # tensor parallel (TP x PP divides GPUS_PER_NODE; the
: "${PP:=2}"                            # pipeline stages   rest is data parallel)
: "${PIPELINE_SCHEDULE:=}"              # 2bw | flush | gpipe; empty: 2bw when PP > 1
: "${DELAY_COMPENSATION:=predict}"      # 2bw | pipedream: none | predict | dc (docs/convergence.md)
: "${DIST_TIMEOUT_MINUTES:=10}"         # a stuck collective fails after this long
# model: GPT 345M
: "${NUM_LAYERS:=24}" "${HIDDEN_SIZE:=1024}" "${NUM_ATTENTION_HEADS:=16}" "${SEQ_LENGTH:=1024}"
: "${PRECISION:=bf16}"                  # bf16 | fp16 | fp32
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=256}"           # sequences per optimizer step
: "${TRAIN_ITERS:=50000}" "${LR:=3e-4}" "${MIN_LR:=3e-5}" "${LR_WARMUP_ITERS:=500}"
# data: a tools/preprocess_data.py output prefix (without .bin/.idx); empty: --mock-data
: "${DATA_PATH:=}"
: "${TOKENIZER_TYPE:=GPT2BPETokenizer}"
: "${VOCAB_FILE:=gpt2-vocab.json}"      # GPT2BPETokenizer (README: where to get them)
: "${MERGE_FILE:=gpt2-merges.txt}"
: "${TOKENIZER_MODEL:=}"                # SentencePieceTokenizer / HuggingFaceTokenizer instead
: "${VOCAB_SIZE:=50257}"                # --mock-data only
# outputs (empty: off)
: "${CHECKPOINT_DIR:=}"                 # --save and --load: a restarted run resumes from here
: "${SAVE_INTERVAL:=1000}" "${LOG_INTERVAL:=10}" "${TENSORBOARD_DIR:=}"

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# --standalone: a private rendezvous on a free local port, so several runs can share the machine.
DISTRIBUTED_ARGS=(--standalone --nproc-per-node "$GPUS_PER_NODE")

GPT_MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_ATTENTION_HEADS" --seq-length "$SEQ_LENGTH"
)

TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
    --lr-warmup-iters "$LR_WARMUP_ITERS" --weight-decay 0.1 --clip-grad 1.0
)
if [[ "$PRECISION" != fp32 ]]; then TRAINING_ARGS+=(--"$PRECISION"); fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    ${PIPELINE_SCHEDULE:+--pipeline-schedule "$PIPELINE_SCHEDULE"}
    --distributed-timeout-minutes "$DIST_TIMEOUT_MINUTES"
)
# 2BW reads weights one update old: predict them forward (docs/convergence.md); flush and
# gpipe have no delay to compensate
if [[ "${PIPELINE_SCHEDULE:-$([[ "$PP" -gt 1 ]] && echo 2bw)}" =~ ^(2bw|pipedream)$ ]]; then
    MODEL_PARALLEL_ARGS+=(--delay-compensation "$DELAY_COMPENSATION")
fi

if [[ -n "$DATA_PATH" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 969,30,1 --tokenizer-type "$TOKENIZER_TYPE")
    if [[ -n "$TOKENIZER_MODEL" ]]; then DATA_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
    else DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"); fi
else
    echo "$(basename "$0"): DATA_PATH is empty: training on --mock-data" >&2
    DATA_ARGS=(--mock-data --vocab-size "$VOCAB_SIZE")
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL"
    ${CHECKPOINT_DIR:+--save "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL"}
    ${TENSORBOARD_DIR:+--tensorboard-dir "$TENSORBOARD_DIR"}
)
if [[ -f "$CHECKPOINT_DIR/latest_checkpointed_iteration.txt" ]]; then
    EVAL_AND_LOGGING_ARGS+=(--load "$CHECKPOINT_DIR")  # resume; a first run starts from scratch
fi

exec torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_DIR/pretrain_gpt.py" \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@"
