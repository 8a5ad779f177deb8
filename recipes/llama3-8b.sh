#!/usr/bin/env bash
# Llama-3-8B shapes (32 layers, hidden 4096, FFN 14336, 32 heads / 8 KV groups, vocab 128256,
# RoPE base 500000), sequence 8192, TP=2 with sequence parallelism on 2 GPUs (H200 141 GB: the
# distributed optimizer state of 8B over TP=2 is ~72 GB per GPU). Mock data unless --data-path is given.
#   bash recipes/llama3-8b.sh             overlap on (--overlap-tp auto)
#   OVERLAP=off bash recipes/llama3-8b.sh baseline: Megatron's path, overlap off
# Add flags after the script name, e.g. `--recompute-granularity selective` where attention is not fused.
set -euo pipefail
# At TP 2 two sequences per micro-batch (same global batch): off 4794.1 -> 4759.6 / 4767.8 ms per iteration, signal
# 4670.9 -> 4595.4 / 4582.9 (1.026x of off -> 1.036x / 1.040x; benchmarks/e2e-tp2_h200x2_2026-11-28.md): the layers'
# fixed per-op costs are amortised over GEMMs twice as long. The peak is off's, 136 GiB reserved of an H200's 140
# (91 GB allocated); MBS=1 where that does not fit. At TP 4 likewise: off 2700.3 -> 2652.0, signal 2502.3 -> 2445.5 ms
# (1.079x -> 1.084x; 74.5 GiB reserved; benchmarks/e2e-tp4_h200x4_2026-11-28.md). At TP 8 not measured: 1.
MBS=${MBS:-$(( ${TP:-2} <= 4 ? 2 : 1 ))}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RECIPE=llama3-8b
MODEL_ARGS=("${LLAMA_ARGS[@]}"
            --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
            --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
            --vocab-size 128256 --rotary-base 500000)
ITERS=${TRAIN_ITERS:-50}
TRAIN_ARGS=(--micro-batch-size "$MBS" --global-batch-size "${GBS:-8}" --train-iters "$ITERS"
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$(warmup_iters 10 "$ITERS")" --weight-decay 0.1
            --clip-grad 1.0 --init-method-std 0.02 --use-distributed-optimizer --seed 1234)
run_recipe "$@"
