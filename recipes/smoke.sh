#!/usr/bin/env bash
# Smoke test of the whole training path: a tiny Llama-style GPT on 2 GPUs (TP=2, sequence parallel),
# Megatron's mock data, about a minute (~1.5 min the first time on a machine); W&B offline (wandb/ under OUT_DIR),
# TensorBoard, train.log.
#   bash recipes/smoke.sh                 overlap on (--overlap-tp auto)
#   OVERLAP=off bash recipes/smoke.sh     the same run, overlap off (baseline)
# Both under Megatron's full-iteration CUDA graphs unless GRAPHS=local|none says otherwise.
# Then: python -m overlap_tp.training.report runs/smoke-off/train.log runs/smoke-auto/train.log --out runs/report
# At these shapes every collective outlasts its GEMM, and auto's per-op choices (the reduce-scatters on p2p, the
# AllGathers decompose-p2p, signal or off by shape) beat signal in all four rounds that ran both, by 1-8%. It measures
# its candidates once per shape before the first step (~10 s; the first run on a machine, with its compiles, ~1.5 min
# in all).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RECIPE=smoke
GRAPHS=${GRAPHS:-full_iteration}   # measured fastest here, for off and signal alike
MODEL_ARGS=("${LLAMA_ARGS[@]}"
            --num-layers 4 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16
            --num-query-groups 4 --kv-channels 64 --seq-length 2048 --max-position-embeddings 2048
            --vocab-size 32000 --rotary-base 10000)
ITERS=${TRAIN_ITERS:-60}
TRAIN_ARGS=(--micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS"
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$(warmup_iters 5 "$ITERS")" --weight-decay 0.1
            --clip-grad 1.0 --init-method-std 0.02 --seed 1234)
run_recipe "$@"
