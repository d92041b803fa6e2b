#!/usr/bin/env bash
# Pretrain GPT on several machines with torchrun. Run this script once on every node, with the same
# variables everywhere except NODE_RANK; torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT
# gathers the nodes:
#
#   MASTER_ADDR=node001 NODE_RANK=0 bash examples/pretrain_gpt_multi_node.sh   # on node001
#   MASTER_ADDR=node001 NODE_RANK=1 bash examples/pretrain_gpt_multi_node.sh   # on node002
#
# Every variable below can be set in the environment. Extra arguments go to pretrain_gpt.py after
# the ones set here, so they win (the last occurrence of a flag counts): e.g. `--fp16`,
# `--wandb-project NAME`, `--log-file run.jsonl`, `--recompute-activations`.
set -euo pipefail

: "${NNODES:=2}"                        # machines in the job
: "${NODE_RANK:=${SLURM_NODEID:-0}}"    # this machine's index, 0..NNODES-1 (under srun: Slurm's)
: "${GPUS_PER_NODE:=8}"                 # processes per machine, one per GPU
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0, reachable from every node}"
: "${MASTER_PORT:=6000}"                # a free TCP port on MASTER_ADDR
: "${RDZV_BACKEND:=c10d}"               # c10d: ranks follow join order (torchrun warns that it
                                        # ignores NODE_RANK); static: NODE_RANK fixes them
: "${RDZV_ID:=gpt-${MASTER_PORT}}"      # same on all nodes, different for concurrent jobs
: "${RDZV_JOIN_TIMEOUT:=600}"           # seconds to wait for every node before giving up
: "${TP:=4}"                            # tensor parallel: keep within one node (fast links)
: "${PP:=4}"                            # pipeline stages (TP x PP divides NNODES x GPUS_PER_NODE;
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

DISTRIBUTED_ARGS=(
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
    --rdzv-backend "$RDZV_BACKEND" --rdzv-id "$RDZV_ID" --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
    --rdzv-conf "join_timeout=$RDZV_JOIN_TIMEOUT"
)

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

# exec: torchrun receives the signals (SIGTERM from Slurm) and passes them to the workers.
exec torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_DIR/pretrain_gpt.py" \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@"
