# Session 14, call 5 (nvidia-h200, ONE GPU): --overlap-moe auto on a GPU for the first time: the MoE layer at EP 1
# (4 experts: the per-rank experts of EP 2 with 8) with a new routing every step, off / signal / auto against
# Megatron's MoELayer: auto's trial calls (CUDA events), its decision (one all-reduce) and what it kept.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s14_five
step moe_auto 300 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --methods signal,off,auto --out $W --name moe_layer_ep1_auto
grep -E "^\| |auto\)|Error" $W/moe_auto.out | head -20
