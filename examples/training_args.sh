# Sourced by the launch scripts after they set their variables: builds the array `args` of
# pretrain_gpt.py / pretrain_bert.py flags from them. Variables read (the scripts document them):
# TP PP PIPELINE_SCHEDULE NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH PRECISION
# MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TRAIN_ITERS LR MIN_LR LR_WARMUP_ITERS LOG_INTERVAL
# DATA_PATH TOKENIZER_TYPE VOCAB_FILE MERGE_FILE TOKENIZER_MODEL VOCAB_SIZE
# CHECKPOINT_DIR SAVE_INTERVAL TENSORBOARD_DIR, and optionally DIST_TIMEOUT_MINUTES,
# LR_DECAY_STYLE (cosine), WEIGHT_DECAY (0.1), SPLIT (969,30,1).
# shellcheck shell=bash

args=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_ATTENTION_HEADS" --seq-length "$SEQ_LENGTH"
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR"
    --lr-decay-style "${LR_DECAY_STYLE:-cosine}" --lr-warmup-iters "$LR_WARMUP_ITERS"
    --weight-decay "${WEIGHT_DECAY:-0.1}" --clip-grad 1.0 --log-interval "$LOG_INTERVAL"
)
if [[ -n "${PIPELINE_SCHEDULE:-}" ]]; then  # else pretrain_*.py's default: 2bw when PP > 1
    args+=(--pipeline-schedule "$PIPELINE_SCHEDULE")
fi
if [[ -n "${DIST_TIMEOUT_MINUTES:-}" ]]; then
    args+=(--distributed-timeout-minutes "$DIST_TIMEOUT_MINUTES")
fi
if [[ "$PRECISION" != fp32 ]]; then
    args+=(--"$PRECISION")
fi
if [[ -z "$DATA_PATH" ]]; then
    echo "$(basename "$0"): DATA_PATH is empty: training on --mock-data" >&2
    args+=(--mock-data --vocab-size "$VOCAB_SIZE")
else
    args+=(--data-path "$DATA_PATH" --split "${SPLIT:-969,30,1}" --tokenizer-type "$TOKENIZER_TYPE")
    if [[ -n "${TOKENIZER_MODEL:-}" ]]; then
        args+=(--tokenizer-model "$TOKENIZER_MODEL")
    elif [[ -n "${MERGE_FILE:-}" ]]; then
        args+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
    else
        args+=(--vocab-file "$VOCAB_FILE")
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
