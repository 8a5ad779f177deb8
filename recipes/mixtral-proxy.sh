#!/usr/bin/env bash
# Mixtral-8x7B layer shapes (hidden 4096, expert FFN 14336, 8 experts, top-2, 32 heads / 8 KV groups,
# vocab 32000, RoPE base 1e6), sequence 4096, on 2 GPUs: attention TP=2 with sequence parallelism, the
# experts EP=2 with expert TP=1 (4 whole experts per GPU), Megatron's alltoall dispatcher semantics.
# Estimate per GPU (bf16 params + fp32 grads + fp32 master + Adam = 18 B/param, expert DP = dense DP = 1):
# one layer's 4 local experts 705 M params -> 12.7 GB, its attention 21 M -> 0.4 GB, ~1 GB activations
# (2048 tokens per rank, 4096 routed rows); embedding and output layer 131 M -> 2.4 GB; so ~9 layers in
# ~130 GB. NUM_LAYERS defaults to 8 to leave room for NCCL/allocator overhead (measured on 2 x H200: max
# allocated 123.5 GB per GPU, either mode).
#   bash recipes/mixtral-proxy.sh              overlap on (--overlap-tp auto --overlap-moe auto)
#   OVERLAP=off bash recipes/mixtral-proxy.sh  baseline: Megatron's MoE layer (alltoall dispatcher), overlap off
# Only the MoE overlap against the baseline: OVERLAP=off bash recipes/mixtral-proxy.sh --overlap-moe auto
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RECIPE=mixtral-proxy
MOE_ARGS=(--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall
          --expert-model-parallel-size "${EP:-2}" --expert-tensor-parallel-size 1
          --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2)
MODEL_ARGS=("${LLAMA_ARGS[@]}" "${MOE_ARGS[@]}"
            --num-layers "${NUM_LAYERS:-8}" --hidden-size 4096 --ffn-hidden-size 14336
            --num-attention-heads 32 --num-query-groups 8 --kv-channels 128 --seq-length 4096
            --max-position-embeddings 32768 --vocab-size 32000 --rotary-base 1000000)
ITERS=${TRAIN_ITERS:-30}
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size "${GBS:-8}" --train-iters "$ITERS"
            --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters "$(warmup_iters 5 "$ITERS")" --weight-decay 0.1
            --clip-grad 1.0 --init-method-std 0.02 --use-distributed-optimizer --seed 1234)
# Dropless routing sends the token counts to the host every step, so neither Megatron's MoE layer nor overlap_tp's
# can be captured (with --moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity the whole layer could be;
# full_iteration graphs are refused for dropless MoE). Per-layer graphs of attention only (GRAPHS=local, with
# --cuda-graph-modules attn) abort in megatron-core 0.19.2 on both sides: its local graph manager captures the whole
# layer's forward, MoE included, and the alltoall dispatcher's device-to-host sync of the token counts fails inside
# the capture (cudaErrorCapturedEvent, with the overlap off too). So this recipe runs both sides eagerly
# unless GRAPHS is given.
run_moe_recipe "$@"
