# Session 12, call 5 (nvidia-h200, ONE GPU), issue 25 item 1: the MoE layer's own cost with no all-to-all. EP = 1
# with 4 experts is one rank's share at EP = 2 with 8 (2 x tokens rows over 4 local experts): Megatron's MoELayer
# (SequentialMLP), OverlapMoELayer off and signal, forward + backward, with the kernel tables (--profile); the
# expert ops against the sequential path at EP = 1.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s12_five && mkdir -p $W/prof
step moe_layer 300 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192,16384 \
  --routing uniform,zipf --methods signal,off --reps 20 --profile $W/prof --out $W --name moe_layer_ep1
step moe 200 torchrun --nproc-per-node 1 -m overlap_tp.bench moe --experts 4 --tokens 8192,16384 --reps 20 \
  --out $W --name moe_ep1
grep -E "^\| " $W/moe_layer_ep1.md; grep -E "^\| " $W/moe_ep1.md
for f in $W/prof/uniform.t8192_*.txt; do echo "== $f"; head -22 $f | cut -c1-150; done
