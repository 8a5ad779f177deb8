# Session 16, call 16 (ONE GPU): after the review commit (SignaledGemm reads dst's and bias's pointers once per
# launch): the direct-launch and tile-rule GPU tests.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_sixteen
step gpu_tests 240 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_direct_launch_gpu.py \
  $REPO/tests/gpu/test_tile_rule_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -8
