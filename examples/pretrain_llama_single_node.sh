#!/usr/bin/env bash
# Pretrain a Llama-style GPT (Llama 3 8B's shape: RMSNorm, SwiGLU, rotary positions, grouped-query
# attention, no biases, untied output layer) on one machine with torchrun; the flags are
# Megatron-LM's. With a Hugging Face tokenizer directory (e.g. a local copy of Meta's Llama 3
# tokenizer: tokenizer.json and its config) as TOKENIZER_MODEL. Smoke test on a laptop:
#
#   GPUS_PER_NODE=2 TP=1 PP=2 NUM_LAYERS=2 HIDDEN_SIZE=64 FFN_HIDDEN_SIZE=128 \
#   NUM_ATTENTION_HEADS=4 NUM_QUERY_GROUPS=2 SEQ_LENGTH=64 MICRO_BATCH_SIZE=2 GLOBAL_BATCH_SIZE=8 \
#   TRAIN_ITERS=20 LR_WARMUP_ITERS=2 PRECISION=fp32 VOCAB_SIZE=512 \
#   bash examples/pretrain_llama_single_node.sh
#
# Every variable below can be set in the environment. Extra arguments go to pretrain_gpt.py after
# the ones set here, so they win (the last occurrence of a flag counts). tools/export_to_hf.py
# writes the checkpoint as LlamaForCausalLM.
set -euo pipefail

: "${GPUS_PER_NODE:=8}"                 # processes, one per GPU
: "${TP:=4}"                            # tensor parallel (TP x PP divides GPUS_PER_NODE; the
: "${PP:=2}"                            # pipeline stages   rest is data parallel)
: "${PIPELINE_SCHEDULE:=}"              # 2bw | flush | gpipe; empty: 2bw when PP > 1
: "${DELAY_COMPENSATION:=predict}"      # 2bw | pipedream: none | predict | dc (docs/convergence.md)
: "${DIST_TIMEOUT_MINUTES:=10}"         # a stuck collective fails after this long
# model: Llama 3 8B's shape
: "${NUM_LAYERS:=32}" "${HIDDEN_SIZE:=4096}" "${FFN_HIDDEN_SIZE:=14336}"
: "${NUM_ATTENTION_HEADS:=32}" "${NUM_QUERY_GROUPS:=8}" "${SEQ_LENGTH:=8192}"
: "${ROTARY_BASE:=500000}"
: "${PRECISION:=bf16}"                  # bf16 | fp16 | fp32
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=128}"           # sequences per optimizer step
: "${TRAIN_ITERS:=100000}" "${LR:=3e-4}" "${MIN_LR:=3e-5}" "${LR_WARMUP_ITERS:=2000}"
# data: a tools/preprocess_data.py output prefix (without .bin/.idx), made with the same tokenizer;
# empty: --mock-data
: "${DATA_PATH:=}"
: "${TOKENIZER_TYPE:=HuggingFaceTokenizer}"
: "${TOKENIZER_MODEL:=}"                # the tokenizer's directory (or a SentencePiece .model with
                                        # TOKENIZER_TYPE=Llama2Tokenizer)
: "${VOCAB_SIZE:=128256}"               # --mock-data only
# outputs (empty: off)
: "${CHECKPOINT_DIR:=}"                 # --save and --load: a restarted run resumes from here
: "${SAVE_INTERVAL:=1000}" "${LOG_INTERVAL:=10}" "${TENSORBOARD_DIR:=}"

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# --standalone: a private rendezvous on a free local port, so several runs can share the machine.
DISTRIBUTED_ARGS=(--standalone --nproc-per-node "$GPUS_PER_NODE")

GPT_MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "$NUM_ATTENTION_HEADS" --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
    --position-embedding-type rope --rotary-base "$ROTARY_BASE"
    --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS"
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
)

TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
    --lr-warmup-iters "$LR_WARMUP_ITERS" --weight-decay 0.1 --clip-grad 1.0
    --adam-beta1 0.9 --adam-beta2 0.95
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
    : "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the tokenizer DATA_PATH was made with}"
    DATA_ARGS=(--data-path "$DATA_PATH" --split 969,30,1 --tokenizer-type "$TOKENIZER_TYPE"
               --tokenizer-model "$TOKENIZER_MODEL")
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
