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
: "${PIPELINE_SCHEDULE:=}"              # 2bw | flush | gpipe; empty: 2bw when PP > 1

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

# shellcheck source=examples/training_args.sh
source "$REPO_DIR/examples/training_args.sh"

# --standalone: a private rendezvous on a free local port, so several runs can share the machine.
exec torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" \
    "$REPO_DIR/pretrain_gpt.py" "${args[@]}" "$@"
