#!/usr/bin/env bash
# Qwen3-30B-A3B layer shapes, scaled down to two GPUs: hidden 2048, 32 heads / 4 KV groups of 128 (GQA), q/k norms,
# every layer MoE: 128 routed experts of FFN 768, top-8, no shared expert; vocab 151936, sequence 4096, RoPE base 1e6.
# Layout: attention TP=2 with sequence parallelism, the experts EP=2 with expert TP=1 (64 whole experts per GPU),
# Megatron's alltoall dispatcher semantics.
# Estimate per GPU (bf16 params + fp32 grads + fp32 master + Adam = 18 B/param, DP = 1): a layer's 64 local experts
# 302 M params -> 5.4 GB, its attention 10 M -> 0.2 GB; embedding and output layer 311 M -> 5.6 GB; NUM_LAYERS 6 ->
# ~39 GB before activations (2048 tokens per rank, 16384 routed rows).
#   bash recipes/qwen3-moe-proxy.sh              overlap on (--overlap-tp auto --overlap-moe auto)
#   OVERLAP=off bash recipes/qwen3-moe-proxy.sh  baseline: Megatron's layers, overlap off
#   TP=1 EP=1 NUM_LAYERS=2 bash recipes/qwen3-moe-proxy.sh   one GPU: Megatron's layers (nothing to overlap)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RECIPE=qwen3-moe-proxy
MOE_ARGS=(--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 --moe-router-load-balancing-type aux_loss
          --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall
          --expert-model-parallel-size "${EP:-2}" --expert-tensor-parallel-size 1)
MODEL_ARGS=("${LLAMA_ARGS[@]}" "${MOE_ARGS[@]}" --qk-layernorm --norm-epsilon 1e-6
            --num-layers "${NUM_LAYERS:-6}" --hidden-size 2048 --ffn-hidden-size 6144
            --num-attention-heads 32 --num-query-groups 4 --kv-channels 128 --seq-length 4096
            --max-position-embeddings 32768 --vocab-size 151936 --rotary-base 1000000)
ITERS=${TRAIN_ITERS:-30}
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size "${GBS:-8}" --train-iters "$ITERS"
            --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters "$(warmup_iters 5 "$ITERS")" --weight-decay 0.1
            --clip-grad 1.0 --init-method-std 0.02 --use-distributed-optimizer --seed 1234)
run_moe_recipe "$@"
