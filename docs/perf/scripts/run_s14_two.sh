# Session 14, call 2 (nvidia-h200, ONE GPU). Call 1's `bench gemm` at the smoke recipe's shapes timed eager
# back-to-back calls: ours 55-120 us whatever the tile, cuBLAS 24-46 us, i.e. the host's launch rate of the
# JIT-launched kernel, not the GPU. bench gemm now times graph replays (the smoke trains under full-iteration
# graphs); bench layer now runs at TP 1 (call 1 refused WORLD_SIZE 1).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s14_two
SMALL=128x128x64/4/8,128x128x64/4/4,64x256x64/4/4,128x64x64/4/4,64x128x64/4/4
step gemm_smoke 150 python3 -m overlap_tp.bench gemm --layers smoke --seq 4096 --comm-sms 0 --configs $SMALL \
  --rounds 7 --out $W --name gemm_smoke_graphs
grep -E "cuBLAS/ours median" $W/gemm_smoke.out
step gemm_l8b 120 python3 -m overlap_tp.bench gemm --layers l8b --seq 8192 --comm-sms 0 \
  --configs 128x256x64/4/8 --rounds 5 --out $W --name gemm_l8b_graphs
grep -E "cuBLAS/ours median" $W/gemm_l8b.out
step layer_tp1 170 torchrun --nproc-per-node 1 -m overlap_tp.bench layer --graphs --models smoke --seq 2048 \
  --micro-batch 2 --configs megatron,off,signal-p2p --reps 60 --rounds 6 --out $W --name layer_tp1_smoke
grep -E "^\| smoke|Error" $W/layer_tp1_smoke.md $W/layer_tp1.out | head
step layer_tp1_8b 140 torchrun --nproc-per-node 1 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --configs megatron,off,signal-p2p --reps 30 --rounds 5 --out $W --name layer_tp1_l8b
grep -E "^\| l8b|Error" $W/layer_tp1_l8b.md $W/layer_tp1_8b.out | head
