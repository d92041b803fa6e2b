#!/usr/bin/env bash
# Zero-shot evaluation of a GPT checkpoint (any training layout) with tools/evaluate_perplexity.py.
# Every variable can be set from the environment, e.g.
#   CHECKPOINT_DIR=checkpoints/gpt DATA_PATH=data/wiki_text_document \
#       bash examples/evaluate_perplexity.sh
#   CHECKPOINT_DIR=checkpoints/gpt INPUT=wikitext-103/wiki.test.tokens OVERLAP=256 \
#       TOKENIZER_ARGS="--tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \
#       --merge-file gpt2-merges.txt" bash examples/evaluate_perplexity.sh
#   CHECKPOINT_DIR=checkpoints/gpt TASK=lambada INPUT=lambada_test.jsonl STRICT=1 \
#       bash examples/evaluate_perplexity.sh
# Model and tokenizer flags left out come from the checkpoint. See docs/checkpoints.md.
set -euo pipefail

: "${CHECKPOINT_DIR:=checkpoints/gpt}"  # --save directory of pretrain_gpt.py
: "${TASK:=perplexity}"                 # perplexity | lambada
: "${DATA_PATH:=}"                      # preprocessed dataset prefix (perplexity), or ...
: "${INPUT:=}"                          # ... raw text (perplexity) / JSON lines (lambada)
: "${OVERLAP:=}"                        # --overlapping-eval stride (WikiText-103 protocol)
: "${STRICT:=0}"                        # 1: LAMBADA target is the whole last word
: "${SEQ_LENGTH:=}"                     # window length (default: the checkpoint's)
: "${TP:=1}"                            # tensor-parallel size
: "${GPUS_PER_NODE:=$TP}"               # processes: TP x data-parallel replicas
: "${MICRO_BATCH_SIZE:=8}"
: "${TOKENIZER_ARGS:=}"                 # default: the tokenizer recorded in the checkpoint
: "${OUTPUT:=results/${TASK}.json}"

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"  # also without `pip install -e .`

EVAL_ARGS=(
    --load "$CHECKPOINT_DIR" --task "$TASK" --tensor-model-parallel-size "$TP"
    --micro-batch-size "$MICRO_BATCH_SIZE" --output "$OUTPUT"
    ${DATA_PATH:+--data-path "$DATA_PATH"} ${INPUT:+--input "$INPUT"}
    ${OVERLAP:+--overlapping-eval "$OVERLAP"} ${SEQ_LENGTH:+--seq-length "$SEQ_LENGTH"}
)
if [[ "$STRICT" == 1 ]]; then EVAL_ARGS+=(--strict-lambada); fi
read -ra TOKENIZER_FLAGS <<< "$TOKENIZER_ARGS"

torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" "$REPO_DIR/tools/evaluate_perplexity.py" \
    "${EVAL_ARGS[@]}" "${TOKENIZER_FLAGS[@]}"
echo "results written to $OUTPUT"
