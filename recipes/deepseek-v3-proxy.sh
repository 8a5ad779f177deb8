#!/usr/bin/env bash
# DeepSeek-V3 layer shapes, scaled down to two GPUs: hidden 7168, 128 heads of multi-latent attention (query latent
# 1536, key-value latent 512, head 128 + 64 rotary, value head 128, the latents normalized), the first layer dense
# (FFN 18432), the others MoE: 16 routed experts of FFN 2048, top-4, sigmoid scores with expert bias and a sequence
# auxiliary loss, one shared expert of FFN 2048; vocab 32000, sequence 4096, RoPE (DeepSeek-V3's 4K pre-training).
# Layout: attention TP=2 with sequence parallelism, the routed experts EP=2 with expert TP=1 (8 whole experts per GPU),
# Megatron's alltoall dispatcher semantics; the shared expert and the dense layer on the TP linears.
# Estimate per GPU (bf16 params + fp32 grads + fp32 master + Adam = 18 B/param, DP = 1): an MoE layer's 8 local
# experts 352 M params -> 6.3 GB, its attention and shared expert ~130 M -> 2.3 GB; the dense layer ~300 M -> 5.4 GB;
# embedding and output layer 229 M -> 4.1 GB; NUM_LAYERS 4 (1 dense + 3 MoE) -> ~35 GB before activations.
# The pattern follows NUM_LAYERS: --moe-layer-freq "([0]*1+[1]*(NUM_LAYERS-1))".
#   bash recipes/deepseek-v3-proxy.sh              overlap on (--overlap-tp auto --overlap-moe auto)
#   OVERLAP=off bash recipes/deepseek-v3-proxy.sh  baseline: Megatron's layers, overlap off
#   TP=1 EP=1 NUM_LAYERS=2 bash recipes/deepseek-v3-proxy.sh   one GPU: Megatron's layers (nothing to overlap)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RECIPE=deepseek-v3-proxy
LAYERS=${NUM_LAYERS:-4}
if [[ ! $LAYERS =~ ^[2-9]$|^[1-9][0-9]+$ ]]; then
  echo "[recipe] NUM_LAYERS=$LAYERS: expected a whole number >= 2 (the first layer is dense, the rest MoE)" >&2
  exit 2
fi
MLA_ARGS=(--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
          --qk-pos-emb-head-dim 64 --v-head-dim 128 --rope-type rope --qk-layernorm)
MOE_ARGS=(--num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048
          --moe-layer-freq "([0]*1+[1]*$(( LAYERS - 1 )))" --moe-router-score-function sigmoid
          --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5
          --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-token-dispatcher-type alltoall
          --expert-model-parallel-size "${EP:-2}" --expert-tensor-parallel-size 1)
MODEL_ARGS=(--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear --position-embedding-type rope
            --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 --bf16
            --attention-softmax-in-fp32 --tokenizer-type NullTokenizer
            "${MLA_ARGS[@]}" "${MOE_ARGS[@]}"
            --num-layers "$LAYERS" --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
            --seq-length 4096 --max-position-embeddings 4096 --vocab-size 32000 --rotary-base 10000)
ITERS=${TRAIN_ITERS:-30}
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size "${GBS:-8}" --train-iters "$ITERS"
            --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters "$(warmup_iters 5 "$ITERS")" --weight-decay 0.1
            --clip-grad 1.0 --init-method-std 0.006 --use-distributed-optimizer --seed 1234)
run_moe_recipe "$@"
