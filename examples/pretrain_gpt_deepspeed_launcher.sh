#!/usr/bin/env bash
# Pretrain GPT with the DeepSpeed launcher, for clusters set up for it (a hostfile and passwordless
# ssh between nodes). Only the launcher is DeepSpeed's: it starts one process per slot with RANK,
# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set and appends --local_rank=N, which
# pretrain_gpt.py accepts and ignores (ranks come from the environment).
#
#   HOSTFILE=my_hostfile MASTER_ADDR=node001 bash examples/pretrain_gpt_deepspeed_launcher.sh
#
# Every variable below can be set in the environment. Extra arguments go to pretrain_gpt.py after
# the ones set here, so they win (the last occurrence of a flag counts).
set -euo pipefail

: "${HOSTFILE:=hostfile}"               # `hostname slots=N` per node, see examples/hostfile.example
: "${MASTER_ADDR:=}"                    # empty: the launcher asks the first host (ssh hostname -I)
: "${MASTER_PORT:=29500}"
: "${LAUNCHER_ARGS:=}"                  # more deepspeed launcher flags, e.g. "--no_ssh_check" or
                                        # "--include node001:0,1@node002"
: "${TP:=4}"                            # tensor parallel: keep within one node (fast links)
: "${PP:=4}"                            # pipeline stages (TP x PP divides the hostfile's slots;
                                        # the rest is data parallel)
: "${PIPELINE_SCHEDULE:=}"              # 2bw | flush | gpipe; empty: 2bw when PP > 1
: "${DELAY_COMPENSATION:=predict}"      # 2bw | pipedream: none | predict | dc (docs/convergence.md)
: "${DIST_TIMEOUT_MINUTES:=10}"         # a stuck collective fails after this long
# model: GPT 2.7B
: "${NUM_LAYERS:=32}" "${HIDDEN_SIZE:=2560}" "${NUM_ATTENTION_HEADS:=32}" "${SEQ_LENGTH:=2048}"
: "${PRECISION:=bf16}"                  # bf16 | fp16 | fp32
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=512}"           # sequences per optimizer step
: "${TRAIN_ITERS:=100000}" "${LR:=1.6e-4}" "${MIN_LR:=1.6e-5}" "${LR_WARMUP_ITERS:=2000}"
# data: a tools/preprocess_data.py output prefix (without .bin/.idx); empty: --mock-data
: "${DATA_PATH:=}"
: "${TOKENIZER_TYPE:=GPT2BPETokenizer}"
: "${VOCAB_FILE:=gpt2-vocab.json}"      # GPT2BPETokenizer (README: where to get them)
: "${MERGE_FILE:=gpt2-merges.txt}"
: "${TOKENIZER_MODEL:=}"                # SentencePieceTokenizer / HuggingFaceTokenizer instead
: "${VOCAB_SIZE:=50257}"                # --mock-data only
# outputs (empty: off)
: "${CHECKPOINT_DIR:=}"                 # --save and --load: a restarted job resumes from here
: "${SAVE_INTERVAL:=1000}" "${LOG_INTERVAL:=10}" "${TENSORBOARD_DIR:=}"

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ ! -f "$HOSTFILE" ]]; then
    echo "$(basename "$0"): error: HOSTFILE=$HOSTFILE does not exist" \
         "(expected lines like 'node001 slots=8', see examples/hostfile.example)" >&2
    exit 2
fi
read -ra DISTRIBUTED_ARGS <<< "$LAUNCHER_ARGS"
DISTRIBUTED_ARGS+=(--hostfile "$HOSTFILE" --master_port "$MASTER_PORT"
                   ${MASTER_ADDR:+--master_addr "$MASTER_ADDR"})

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

exec deepspeed "${DISTRIBUTED_ARGS[@]}" "$REPO_DIR/pretrain_gpt.py" \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@"
