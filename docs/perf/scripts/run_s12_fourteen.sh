# Session 12, call 14 (nvidia-h200, ONE GPU): the one-GPU GPU tests at the session's last code: the MLP boundary at
# TP 1 (compiled kernel, handover), the expert ops, the fused norm, the graph watch.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s12_fourteen
step gpu_one 420 python3 -m pytest -m gpu -q -rA -p no:cacheprovider $REPO/tests/gpu/test_layers_gpu.py \
  $REPO/tests/gpu/test_moe_ops_one_gpu.py $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  -k "one_gpu or moe_ops or fused_add or x_slots or x_sum or sum_slots or never_passes or never_completes or pinned or routing or grouped"
grep -E "^PASSED|^FAILED|^SKIPPED|passed|failed" $W/gpu_one.out | sed 's#.*/tests/#tests/#' | tail -70
