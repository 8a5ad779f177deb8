# Session 16, call 3 (ONE GPU): a new routing's first signaled-GEMM launch finds its compiled kernel by a key of
# its own (signaled_gemm.specialization_key) instead of Triton's binder, and builds no TensorDescriptor (call 2:
# _launch_args 38 us + binder lookup 49 us of the launch's 141 us). Tests: the key at least as fine as Triton's,
# the direct launch; the one-GPU expert-op tests. Then the expert host probe and the MoE layer at EP 1 in rounds
# (s15 call 8: signal 0.93 / 0.99x, off 0.99 / 1.01x of Megatron's MoELayer, zipf / uniform).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_three
step gpu_tests 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_direct_launch_gpu.py \
  $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -8
step probe_expert_host 120 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_expert_host.py
grep -A22 "a2a_gemm forward" $W/probe_expert_host.out | head -50; tail -1 $W/probe_expert_host.out
step moe_layer 240 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf,uniform --methods signal,off --reps 48 --rounds 6 --out $W --name moe_layer_ep1_rounds
grep -E "^\| " $W/moe_layer_ep1_rounds.md
