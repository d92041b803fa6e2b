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

# --- cluster --------------------------------------------------------------------------------------
: "${HOSTFILE:=hostfile}"               # `hostname slots=N` per node, see examples/hostfile.example
: "${MASTER_ADDR:=}"                    # empty: the launcher asks the first host (ssh hostname -I)
: "${MASTER_PORT:=29500}"
: "${LAUNCHER_ARGS:=}"                  # more deepspeed launcher flags, e.g. "--no_ssh_check" or
                                        # "--include node001:0,1@node002"

# --- parallelism (TP x PP must divide the number of slots; the rest is data parallel) -------------
: "${TP:=4}"
: "${PP:=4}"
: "${PIPELINE_SCHEDULE:=}"              # 2bw | flush | gpipe; empty: 2bw when PP > 1

# --- model: GPT 2.7B ------------------------------------------------------------------------------
: "${NUM_LAYERS:=32}"
: "${HIDDEN_SIZE:=2560}"
: "${NUM_ATTENTION_HEADS:=32}"
: "${SEQ_LENGTH:=2048}"
: "${PRECISION:=bf16}"                  # bf16 | fp16 | fp32

# --- training -------------------------------------------------------------------------------------
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=512}"
: "${TRAIN_ITERS:=100000}"
: "${LR:=1.6e-4}"
: "${MIN_LR:=1.6e-5}"
: "${LR_WARMUP_ITERS:=2000}"
: "${LOG_INTERVAL:=10}"

# --- data: a tools/preprocess_data.py output prefix (without .bin/.idx); empty: --mock-data -------
: "${DATA_PATH:=}"
: "${TOKENIZER_TYPE:=GPT2BPETokenizer}"
: "${VOCAB_FILE:=gpt2-vocab.json}"
: "${MERGE_FILE:=gpt2-merges.txt}"
: "${VOCAB_SIZE:=50257}"                # --mock-data only

# --- outputs (empty: off) -------------------------------------------------------------------------
: "${CHECKPOINT_DIR:=}"                 # --save and --load: a restarted job resumes from here
: "${SAVE_INTERVAL:=1000}"
: "${TENSORBOARD_DIR:=}"

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ ! -f "$HOSTFILE" ]]; then
    echo "pretrain_gpt_deepspeed_launcher.sh: error: HOSTFILE=$HOSTFILE does not exist" \
         "(expected lines like 'node001 slots=8', see examples/hostfile.example)" >&2
    exit 2
fi
read -ra launcher_args <<< "$LAUNCHER_ARGS"
launcher_args+=(--hostfile "$HOSTFILE" --master_port "$MASTER_PORT")
if [[ -n "$MASTER_ADDR" ]]; then
    launcher_args+=(--master_addr "$MASTER_ADDR")
fi

# shellcheck source=examples/training_args.sh
source "$REPO_DIR/examples/training_args.sh"

exec deepspeed "${launcher_args[@]}" "$REPO_DIR/pretrain_gpt.py" "${args[@]}" "$@"
