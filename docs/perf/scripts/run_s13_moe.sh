# Session 13, call 4 (nvidia-h200-x2; written in session 11 as run_s12_moe.sh), issue 25: the expert ops and the MoE layer over NVLink and on the
# cross-node proxy (NCCL_P2P_DISABLE=1: NCCL through host memory, all-to-all ~20-22 GB/s on this pair,
# BENCHMARKS.md), every configuration in one process, the proxy's bandwidth recorded by the benchmark's own
# `comm` column. 8192 tokens per rank, uniform and Zipf routing. Session 12 changed the signal path's own cost (no
# host sync per new routing, no store round trip from the layer, shared per-routing work, pinned staging): moe_layer
# shows whether that was the 0.86-0.93x; --routings 8 gives every step a new routing, as training does.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s12_moe
step moe_nvlink 120 torchrun --nproc-per-node 2 -m overlap_tp.bench moe --tokens 8192 --sweep --out $W --name moe_nvlink
step moe_proxy 150 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe --tokens 8192 --sweep \
  --out $W --name moe_proxy
step layer_nvlink 100 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 --routings 8 --out $W --name moe_layer_nvlink
step layer_proxy 120 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 --routings 8 \
  --out $W --name moe_layer_proxy
for f in $W/*.md; do echo "== $f"; grep -E "^\| " $f | head -12; done
