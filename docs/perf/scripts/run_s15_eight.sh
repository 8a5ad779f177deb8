# Session 15, call 8 (nvidia-h200, ONE GPU): the expert plans with raster runs of 32 (call 7: 2-4% faster grouped
# GEMMs than runs of 8). The one-GPU expert-op tests; `bench moe` at EP 1 (the grouped GEMM against per-expert cuBLAS:
# sgemm/cuBLAS, session 14 call 7: 1.13 / 0.93 uniform / zipf on fc1); the MoE layer at EP 1 in rounds (call 6:
# signal 0.94 / 0.99x zipf / uniform).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s15_eight
step gpu_tests 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -5
step moe_ops 150 torchrun --nproc-per-node 1 -m overlap_tp.bench moe --experts 4 --tokens 8192 --reps 20 \
  --out $W --name moe_ep1_gemm
grep -E "^\| " $W/moe_ep1_gemm.md | head -8
step moe_layer 240 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf,uniform --methods signal,off --reps 48 --rounds 6 --out $W --name moe_layer_ep1_rounds
grep -E "^\| " $W/moe_layer_ep1_rounds.md
