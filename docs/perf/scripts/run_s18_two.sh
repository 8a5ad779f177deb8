# Session 18, call 2 (ONE GPU): the signaled GEMM's tile against cuBLAS at the smoke recipe's shapes (s 4096) and
# the 8B layer's (s 8192), TP 2 shards, every SM (the p2p transports' grid): which tiles close the column-parallel
# forward GEMMs' gap (s14: 0.85 / 0.87x at the smoke's qkv / fc1). Then where a p2p ag_gemm call's host time goes at
# t = 2 (cProfile, two ranks on one GPU).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s18_two
CONFIGS=128x128x64/4/4,128x128x64/3/8,128x128x64/5/8,128x256x64/2/8,64x256x64/4/4,64x256x64/3/8,64x128x64/5/4,128x64x64/5/4,256x128x64/3/8
step gemm_smoke 240 python3 -m overlap_tp.bench gemm --layers smoke --seq 4096 --comm-sms 0 --configs $CONFIGS \
  --rounds 5 --out $W --name gemm_tiles_smoke
grep -E "^- |left out" $W/gemm_smoke.out
step gemm_l8b 240 python3 -m overlap_tp.bench gemm --layers l8b --seq 8192 --comm-sms 0 --configs $CONFIGS \
  --rounds 3 --reps 10 --out $W --name gemm_tiles_l8b
grep -E "^- |left out" $W/gemm_l8b.out
step host_t2_profile 90 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --one-gpu --rounds 6 --profile
grep -v "^W1\|^\*\*\*\|OMP\|Warning\|kernels = " $W/host_t2_profile.out | head -60
