#!/usr/bin/env bash
# Zero-shot evaluation of a GPT checkpoint (any training layout) with tools/evaluate_perplexity.py.
# Every variable can be set from the environment, e.g.
#   CHECKPOINT=checkpoints/gpt DATA_PATH=data/wiki_text_document bash examples/evaluate_perplexity.sh
#   CHECKPOINT=checkpoints/gpt INPUT=wikitext-103/wiki.test.tokens OVERLAP=256 \
#       TOKENIZER_ARGS="--tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt" \
#       bash examples/evaluate_perplexity.sh
#   CHECKPOINT=checkpoints/gpt TASK=lambada INPUT=lambada_test.jsonl STRICT=1 bash examples/evaluate_perplexity.sh
# Model and tokenizer flags left out come from the checkpoint. See docs/checkpoints.md.
set -euo pipefail

CHECKPOINT=${CHECKPOINT:-checkpoints/gpt}   # --save directory of pretrain_gpt.py
TASK=${TASK:-perplexity}                    # perplexity | lambada
DATA_PATH=${DATA_PATH:-}                    # preprocessed dataset prefix (perplexity), or ...
INPUT=${INPUT:-}                            # ... raw text (perplexity) / JSON lines (lambada)
OVERLAP=${OVERLAP:-}                        # --overlapping-eval stride (WikiText-103 protocol)
STRICT=${STRICT:-0}                         # 1: LAMBADA target is the whole last word
SEQ_LENGTH=${SEQ_LENGTH:-}                  # window length (default: the checkpoint's)
TP=${TP:-1}                                 # tensor-parallel size
NPROC=${NPROC:-$TP}                         # processes: TP x data-parallel replicas
MICRO_BATCH=${MICRO_BATCH:-8}
TOKENIZER_ARGS=${TOKENIZER_ARGS:-}          # default: the tokenizer recorded in the checkpoint
OUTPUT=${OUTPUT:-results/${TASK}.json}

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

args=(--load "$CHECKPOINT" --task "$TASK" --tensor-model-parallel-size "$TP"
      --micro-batch-size "$MICRO_BATCH" --output "$OUTPUT")
if [[ -n "$DATA_PATH" ]]; then args+=(--data-path "$DATA_PATH"); fi
if [[ -n "$INPUT" ]]; then args+=(--input "$INPUT"); fi
if [[ -n "$OVERLAP" ]]; then args+=(--overlapping-eval "$OVERLAP"); fi
if [[ -n "$SEQ_LENGTH" ]]; then args+=(--seq-length "$SEQ_LENGTH"); fi
if [[ "$STRICT" == 1 ]]; then args+=(--strict-lambada); fi

# Word splitting of TOKENIZER_ARGS into separate flags is intended.
# shellcheck disable=SC2086
torchrun --standalone --nproc-per-node "$NPROC" "$REPO_ROOT/tools/evaluate_perplexity.py" \
    "${args[@]}" $TOKENIZER_ARGS
echo "results written to $OUTPUT"
