# Session 12, call 1 (nvidia-h200, ONE GPU: the 2-GPU kinds were withheld). What one GPU can check and measure:
# - the compiled slot sum and the fused norm's slot path bit for bit (linear_proj's p2p sum in the norm kernel is
#   on by default and had only CPU-interpreter tests), with the rest of the fused-norm GPU tests;
# - host time per call of the op plans at t = 1 plus the per-peer driver calls' cost (issue 20's estimate), with
#   a cProfile of the calls;
# - the grouped signaled expert GEMM against per-expert cuBLAS (issue 25, item 1): bench moe at EP = 1 with 4
#   experts is the per-rank GEMM of EP = 2 with 8 (2 x tokens rows over 4 local experts).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s12_one
step gpu_norm 240 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py -p no:cacheprovider
step host 120 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_host_t1.py --profile
step moe 200 torchrun --nproc-per-node 1 -m overlap_tp.bench moe --experts 4 --tokens 8192,16384 --reps 20 \
  --out $W --name moe_ep1_gemm
grep -E "passed|failed" $W/gpu_norm.out | tail -3; grep -E "^memop|^op=" $W/host.out; grep -E "^\| " $W/moe_ep1_gemm.md
