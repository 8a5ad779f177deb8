# Session 16, call 1 (ONE GPU; the 2-GPU kinds not lent): Triton kernels launched through their C launcher
# (kernels/launch.py, DirectKernel). Tests: the direct launch bitwise against the JIT's, the fallback, capture;
# the one-GPU plan, expert-op and fused-norm tests. Then the host time per launch by path (probe_launch.py),
# per plan call at t = 1 with the direct launch on and off in one process (probe_host_t1.py --ab), and the expert
# op's host path (probe_expert_host.py). Prediction: the signaled GEMM's launch ~55 -> ~20 us (descriptor encoding,
# the argument rebuild and 7 pointer look-ups gone), each plan call ~30-40 us less.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_one
step gpu_tests 240 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_direct_launch_gpu.py \
  $REPO/tests/gpu/test_tile_rule_gpu.py $REPO/tests/gpu/test_moe_ops_one_gpu.py \
  $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -8
step probe_launch 90 python3 $REPO/docs/perf/scripts/probe_launch.py
cat $W/probe_launch.out | head -32
step probe_host_t1 120 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_host_t1.py --ab
grep -E "^op=|memop" $W/probe_host_t1.out
step probe_expert_host 120 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_expert_host.py
tail -25 $W/probe_expert_host.out
