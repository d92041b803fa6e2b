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

# --- machine --------------------------------------------------------------------------------------
: "${GPUS_PER_NODE:=8}"                 # processes, one per GPU

# --- parallelism (TP x PP must divide GPUS_PER_NODE; the rest is data parallel) -------------------
: "${TP:=2}"                            # tensor parallel
: "${PP:=2}"                            # pipeline parallel stages
: "${PIPELINE_SCHEDULE:=2bw}"           # 2bw | flush | gpipe

# --- model: GPT 345M ------------------------------------------------------------------------------
: "${NUM_LAYERS:=24}"
: "${HIDDEN_SIZE:=1024}"
: "${NUM_ATTENTION_HEADS:=16}"
: "${SEQ_LENGTH:=1024}"
: "${PRECISION:=bf16}"                  # bf16 | fp16 | fp32

# --- training -------------------------------------------------------------------------------------
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=256}"           # sequences per optimizer step
: "${TRAIN_ITERS:=50000}"
: "${LR:=3e-4}"
: "${MIN_LR:=3e-5}"
: "${LR_WARMUP_ITERS:=500}"
: "${LOG_INTERVAL:=10}"

# --- data: a tools/preprocess_data.py output prefix (without .bin/.idx); empty: --mock-data -------
: "${DATA_PATH:=}"
: "${TOKENIZER_TYPE:=GPT2BPETokenizer}"
: "${VOCAB_FILE:=gpt2-vocab.json}"      # GPT2BPETokenizer
: "${MERGE_FILE:=gpt2-merges.txt}"      # GPT2BPETokenizer
: "${TOKENIZER_MODEL:=}"                # SentencePieceTokenizer / HuggingFaceTokenizer
: "${VOCAB_SIZE:=50257}"                # --mock-data only

# --- outputs (empty: off) -------------------------------------------------------------------------
: "${CHECKPOINT_DIR:=}"                 # --save and --load: a restarted run resumes from here
: "${SAVE_INTERVAL:=1000}"
: "${TENSORBOARD_DIR:=}"

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

args=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --pipeline-schedule "$PIPELINE_SCHEDULE"
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_ATTENTION_HEADS" --seq-length "$SEQ_LENGTH"
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
    --lr-warmup-iters "$LR_WARMUP_ITERS" --weight-decay 0.1 --clip-grad 1.0
    --log-interval "$LOG_INTERVAL"
)
if [[ "$PRECISION" != fp32 ]]; then
    args+=(--"$PRECISION")
fi
if [[ -z "$DATA_PATH" ]]; then
    echo "pretrain_gpt_single_node.sh: DATA_PATH is empty: training on --mock-data" >&2
    args+=(--mock-data --vocab-size "$VOCAB_SIZE")
else
    args+=(--data-path "$DATA_PATH" --split "969,30,1" --tokenizer-type "$TOKENIZER_TYPE")
    if [[ -n "$TOKENIZER_MODEL" ]]; then
        args+=(--tokenizer-model "$TOKENIZER_MODEL")
    else
        args+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
    fi
fi
if [[ -n "$CHECKPOINT_DIR" ]]; then
    args+=(--save "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL")
    if [[ -f "$CHECKPOINT_DIR/latest_checkpointed_iteration.txt" ]]; then
        args+=(--load "$CHECKPOINT_DIR")  # resume; the first run of a job starts from scratch
    fi
fi
if [[ -n "$TENSORBOARD_DIR" ]]; then
    args+=(--tensorboard-dir "$TENSORBOARD_DIR")
fi

# --standalone: a private rendezvous on a free local port, so several runs can share the machine.
exec torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" \
    "$REPO_DIR/pretrain_gpt.py" "${args[@]}" "$@"
