# Session 16, call 5 (ONE GPU): the fused add + RMSNorm's kernels through JitLauncher (kernels/launch.py: Triton's
# binder for the key, DirectKernel for the launch). Tests: the direct-launch file (the norm kernels' repeat launches
# bitwise), the fused-norm GPU tests (references), the tile-rule plans. The launch probe with the norm rows
# (prediction: ~50 -> ~25 us per norm launch), then the smoke layer at TP 1 eager (host-bound: tiny GEMMs).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_five
step gpu_tests 300 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_direct_launch_gpu.py \
  $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py $REPO/tests/gpu/test_tile_rule_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -8
step probe_launch 90 python3 $REPO/docs/perf/scripts/probe_launch.py
head -18 $W/probe_launch.out
step layer_smoke_eager 200 torchrun --nproc-per-node 1 -m overlap_tp.bench layer --models smoke --seq 2048 \
  --micro-batch 2 --configs megatron,off,signal-p2p --reps 60 --rounds 6 --out $W --name layer_tp1_smoke_eager
grep -E "^\| " $W/layer_tp1_smoke_eager.md
