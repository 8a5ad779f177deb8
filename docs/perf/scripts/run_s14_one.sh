# Session 14, call 1 (nvidia-h200, ONE GPU: the 2-GPU kinds were not lent at the session's start).
# What one GPU can say about the end-to-end gap (smoke 0.945x under full-iteration graphs, session 13):
# - the signaled GEMM against cuBLAS at the smoke recipe's shapes (M 4096, N 768-2816, K 512-1408: 96-352 tiles
#   of the default 128x256 for 132 SMs) and at the 8B layer's, with the default tile and alternatives, so a
#   shape-aware tile choice can be made from data;
# - the layer at TP 1 (no communication, one process) under graphs: what our layers compute (fused bda + norm,
#   the signaled GEMMs) against Megatron's layer, at the smoke layer (s 2048, micro-batch 2) and the 8B layer;
# - the one-GPU GPU tests at this commit (the multi-GPU ones skip).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s14_one
SMALL=128x256x64/4/8,128x128x64/4/8,128x128x64/4/4,128x128x128/3/8,64x256x64/4/4,128x64x64/4/4,256x128x64/3/8
step gemm_smoke 150 python3 -m overlap_tp.bench gemm --layers smoke --seq 4096 --comm-sms 0 --configs $SMALL \
  --rounds 7 --out $W --name gemm_smoke
grep -E "cuBLAS/ours median" $W/gemm_smoke.out
step gemm_l8b 150 python3 -m overlap_tp.bench gemm --layers l8b --seq 8192 --comm-sms 0 \
  --configs 128x256x64/4/8,128x128x64/4/8,256x128x64/3/8 --rounds 5 --out $W --name gemm_l8b
grep -E "cuBLAS/ours median" $W/gemm_l8b.out
step layer_tp1 170 torchrun --nproc-per-node 1 -m overlap_tp.bench layer --graphs --models smoke --seq 2048 \
  --micro-batch 2 --configs megatron,off,signal-p2p --reps 60 --rounds 6 --out $W --name layer_tp1_smoke
grep -E "^\| smoke" $W/layer_tp1_smoke.md
step layer_tp1_8b 120 torchrun --nproc-per-node 1 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --configs megatron,off,signal-p2p --reps 30 --rounds 5 --out $W --name layer_tp1_l8b
grep -E "^\| l8b" $W/layer_tp1_l8b.md
step gpu_tests 100 python3 -m pytest -m gpu -q $REPO/tests/gpu/test_layers_gpu.py $REPO/tests/gpu/test_attention_gpu.py \
  $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed" $W/gpu_tests.out | tail -3
