# Session 15, call 2 (nvidia-h200, ONE GPU): compiled signaled GEMMs shared by every SignaledGemm (looked up by
# Triton's own specialization key), against call 1 (a new routing's first launch through the JIT: 179 us of host
# time before the expert GEMM starts). Expected: "to the GEMM's launch" ~100-150 us shorter.
# - the one-GPU expert-op tests, with the new one: 12 routings, their kernels shared, each checked against cuBLAS;
# - the host time of a new routing's expert call (probe_expert_host.py);
# - the MoE layer at EP 1 (no profiler), both routings.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s15_two
step gpu_tests 180 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -5
step host 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_expert_host.py
grep -v -i warn $W/host.out | grep -E "forward|SignaledGemm|_ExpertState|dispatch_plan|_dispatch_state"
step moe_layer 200 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf,uniform --methods signal,off --out $W --name moe_layer_ep1
grep -E "^\| " $W/moe_layer_ep1.md
