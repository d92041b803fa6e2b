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

# --- cluster --------------------------------------------------------------------------------------
: "${NNODES:=2}"                        # machines in the job
: "${NODE_RANK:=${SLURM_NODEID:-0}}"    # this machine's index, 0..NNODES-1 (under srun: Slurm's)
: "${GPUS_PER_NODE:=8}"                 # processes per machine, one per GPU
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0, reachable from every node}"
: "${MASTER_PORT:=6000}"                # a free TCP port on MASTER_ADDR
: "${RDZV_BACKEND:=c10d}"               # c10d: ranks follow join order (torchrun warns that it
                                        # ignores NODE_RANK); static: NODE_RANK fixes them
: "${RDZV_ID:=gpt-${MASTER_PORT}}"      # same on all nodes, different for concurrent jobs
: "${RDZV_JOIN_TIMEOUT:=600}"           # seconds to wait for every node before giving up
: "${DIST_TIMEOUT_MINUTES:=10}"         # a stuck collective fails after this long

# --- parallelism (TP x PP must divide NNODES x GPUS_PER_NODE; the rest is data parallel) ----------
: "${TP:=4}"                            # tensor parallel: keep within one node (fast links)
: "${PP:=4}"                            # pipeline parallel stages
: "${PIPELINE_SCHEDULE:=}"              # 2bw | flush | gpipe; empty: 2bw when PP > 1

# --- model: GPT 2.7B ------------------------------------------------------------------------------
: "${NUM_LAYERS:=32}"
: "${HIDDEN_SIZE:=2560}"
: "${NUM_ATTENTION_HEADS:=32}"
: "${SEQ_LENGTH:=2048}"
: "${PRECISION:=bf16}"                  # bf16 | fp16 | fp32

# --- training -------------------------------------------------------------------------------------
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=512}"           # sequences per optimizer step
: "${TRAIN_ITERS:=100000}"
: "${LR:=1.6e-4}"
: "${MIN_LR:=1.6e-5}"
: "${LR_WARMUP_ITERS:=2000}"
: "${LOG_INTERVAL:=10}"

# --- data: a tools/preprocess_data.py output prefix (without .bin/.idx); empty: --mock-data -------
: "${DATA_PATH:=}"
: "${TOKENIZER_TYPE:=GPT2BPETokenizer}"
: "${VOCAB_FILE:=gpt2-vocab.json}"      # GPT2BPETokenizer
: "${MERGE_FILE:=gpt2-merges.txt}"      # GPT2BPETokenizer
: "${TOKENIZER_MODEL:=}"                # SentencePieceTokenizer / HuggingFaceTokenizer
: "${VOCAB_SIZE:=50257}"                # --mock-data only

# --- outputs (empty: off) -------------------------------------------------------------------------
: "${CHECKPOINT_DIR:=}"                 # --save and --load: a restarted job resumes from here
: "${SAVE_INTERVAL:=1000}"
: "${TENSORBOARD_DIR:=}"

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# shellcheck source=examples/training_args.sh
source "$REPO_DIR/examples/training_args.sh"

# exec: torchrun receives the signals (SIGTERM from Slurm) and passes them to the workers.
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend "$RDZV_BACKEND" --rdzv-id "$RDZV_ID" \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-conf "join_timeout=$RDZV_JOIN_TIMEOUT" \
    "$REPO_DIR/pretrain_gpt.py" "${args[@]}" "$@"
