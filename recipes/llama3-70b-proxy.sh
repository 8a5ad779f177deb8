#!/usr/bin/env bash
# Llama-3-70B layer shapes (hidden 8192, FFN 28672, 64 heads / 8 KV groups, vocab 128256, RoPE base
# 500000), sequence 8192, TP=2 with sequence parallelism, with as many layers as fit two 141 GB H200s.
# Estimate per GPU (TP=2, DP=1, bf16 params + fp32 grads + fp32 master + Adam = 18 B/param):
# one layer 856 M params -> 7.7 GB + ~2 GB activations (flash attention, no recompute); embedding and
# output layer 2.1 B params -> 19 GB; so ~10 layers in ~130 GB. NUM_LAYERS defaults to 8 to leave room
# for NCCL/allocator overhead. Measured (no TE, GBS 4): 8 layers peak at 94 GB per GPU at TP=2;
# 16 layers at TP=4 (TP=4 NPROC=4) peak at 83 GB.
#   bash recipes/llama3-70b-proxy.sh              overlap on (--overlap-tp auto: at these shapes the long row-parallel
#                                                 GEMMs measured faster under cuBLAS than under the signaled kernel at
#                                                 TP 2, and auto times both per shape)
#   OVERLAP=off bash recipes/llama3-70b-proxy.sh  baseline: Megatron's path, overlap off
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RECIPE=llama3-70b-proxy
MODEL_ARGS=("${LLAMA_ARGS[@]}"
            --num-layers "${NUM_LAYERS:-8}" --hidden-size 8192 --ffn-hidden-size 28672
            --num-attention-heads 64 --num-query-groups 8 --kv-channels 128 --seq-length 8192
            --max-position-embeddings 8192 --vocab-size 128256 --rotary-base 500000)
ITERS=${TRAIN_ITERS:-30}
TRAIN_ARGS=(--micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-8}" --train-iters "$ITERS"
            --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters "$(warmup_iters 5 "$ITERS")" --weight-decay 0.1
            --clip-grad 1.0 --init-method-std 0.008 --use-distributed-optimizer --seed 1234)
run_recipe "$@"
