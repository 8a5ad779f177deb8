# A later 2-GPU call (after run_s19_x2_{1,2,3}.sh; nvidia-h200-x2), written in session 14 (one GPU only): --overlap-moe auto
# (each layer times off and signal in its first calls and keeps the faster; from session 19 off, signal and
# decompose, the fastest) against off, signal and Megatron's MoELayer, over NVLink (session 13: signal 0.97 / 0.96x,
# so auto should keep off unless decompose wins) and on the cross-node proxy (NCCL_P2P_DISABLE=1: signal 1.16 /
# 1.12x, auto should keep signal or decompose); a new routing every step (--routings 8);
# then the expert ops' GPU tests after session 13's GEMM-first order (if run_s15_a.sh did not reach them). Session 15
# (one GPU) cut the expert plans' host time 2-4.6x and reused compiled kernels across routings: the host probe at
# EP 2 first (how long a2a_gemm's forward takes to launch its GEMM; EP 1: ~1.0 ms, ../s15/probe_expert_host.txt).
# Session 17 added the expert ops' p2p transport (copy engines, no SM: --overlap-moe-transport p2p), correct at EP 2
# on one GPU (../s17/): timed here as signal-p2p next to signal (NCCL) over NVLink; not on the proxy (it disables
# NCCL's P2P only: the copy engines would still use NVLink, so signal-p2p is no cross-node stand-in). Session 19 added
# decompose-p2p (cuBLAS per expert over the same copy engines, no per-routing Triton state): timed next to them.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s15_moe
step host 90 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_expert_host.py
grep -E "forward|_dispatch_state|dispatch_plan|_ExpertState|SignaledGemm" $W/host.out
step layer_nvlink 190 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 --routings 8 \
  --methods signal,signal-p2p,decompose-p2p,off,auto --out $W --name moe_layer_nvlink
step layer_proxy 170 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --methods signal,off,auto --out $W --name moe_layer_proxy
for f in $W/*.md; do echo "== $f"; grep -E "^\| " $f | head -8; done
step moe_tests 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_layer_gpu.py -p no:cacheprovider
grep -E "passed|failed" $W/moe_tests.out | tail -3
