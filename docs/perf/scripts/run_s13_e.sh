# Session 13, call 6 (nvidia-h200-x2): the GEMM enqueued before the transfers (AllGather+GEMM, A2A+GEMM; with
# CUDA_DEVICE_MAX_CONNECTIONS=1 the comm chain enqueued first held the GEMM's launch to its end). Correctness
# first (the expert ops at EP 2 and the AllGather+GEMM, both transports, late peers: no hang), then a2a_gemm's
# timeline again (probe_a2a_ep2.py) and the MoE op and layer benchmarks over NVLink and the proxy.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
DEADLINE_S=440
workdir s13_e
step gpu_tests 150 python3 -m pytest -m gpu -x -q -rA $REPO/tests/gpu/test_moe_ops_gpu.py $REPO/tests/gpu/test_ag_gemm_gpu.py \
  -p no:cacheprovider
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.out | tail -14
step a2a 50 env OUT=$W torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_a2a_ep2.py
grep -E "^rank" $W/a2a.out
step layer_nvlink 70 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 --routings 8 --out $W --name moe_layer_nvlink
step moe_nvlink 60 torchrun --nproc-per-node 2 -m overlap_tp.bench moe --tokens 8192 --out $W --name moe_nvlink
step layer_proxy 70 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 --routings 8 \
  --out $W --name moe_layer_proxy
for f in $W/*.md; do echo "== $f"; grep -E "^\| [a-z]" $f | head -6; done
