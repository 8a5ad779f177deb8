# Session 12, call 4 (nvidia-h200, ONE GPU): the one-GPU graph tests (a captured counter wait with a deadline, and
# since this session every replay watched whole: a captured stream wait-value nothing satisfies); the expert ops'
# no-sync test run against the code before the pinned tables (.old = 1e5cf38: it must FAIL there, showing the
# test can catch the sync), then the current code's one-GPU MoE tests again.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s12_four
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old $REPO/.old 2>&1 | grep -v -i warn | tail -2
step gpu_graphs 150 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_graphs_gpu.py -p no:cacheprovider \
  -k "never_passes or never_completes"
step gpu_moe_old 120 env PYTHONPATH=/tmp/old:$PYTHONPATH python3 -m pytest -m gpu -q -rA \
  $REPO/tests/gpu/test_moe_ops_one_gpu.py -k never_synchronizes -p no:cacheprovider
step gpu_norm 150 python3 -m pytest -m gpu -q $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py $REPO/tests/gpu/test_moe_ops_one_gpu.py \
  -p no:cacheprovider
grep -E "^PASSED|^FAILED|passed|failed|Error" $W/gpu_graphs.out | head -8; grep -E "^PASSED|^FAILED|passed|failed|RuntimeError" $W/gpu_moe_old.out | head -6
grep -E "passed|failed" $W/gpu_norm.out | tail -2
