# Session 6, call 6 (nvidia-h200-x8): the tuner's validation at t = 8 and the MoE-ops and layer GPU tests at t = 8.
source .diag/setup_device.sh
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown} CUDA_DEVICE_MAX_CONNECTIONS=1 OVERLAP_TP_GPU_WORLD=8
W=/tmp/w8c; rm -rf $W; mkdir -p $W/tune_t8
pack() { cd $W && tar czf $OUT/s6_x8c.tgz . ; }
trap pack EXIT
timeout 100 torchrun --nproc-per-node 8 -m overlap_tp.tune --op rs --shapes l70b.fc2.s8192,l70b.proj.s16384 \
  --validate $W/tune_t8 --points 12 --top 4 --reps 10 > $W/tune_t8.log 2>&1; echo "== tune t8 exit $?"; tail -6 $W/tune_t8.log | cut -c1-400
t8() {  # name outer_timeout per_test_timeout pytest-args...
  local name=$1 outer=$2 per=$3; shift 3
  timeout $outer python3 -m pytest -m gpu "$@" -v -rA --tb=short --timeout $per --durations=0 -p no:cacheprovider > $W/$name.log 2>&1
  echo "== $name exit $?: $(grep -cE '::.* PASSED' $W/$name.log) passed"; grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" $W/$name.log | tail -4
}
t8 gpu_tests_t8_moe_ops 70 60 $REPO/tests/gpu/test_moe_ops_gpu.py -k "uniform or odd or late"
t8 gpu_tests_t8_layers 90 80 $REPO/tests/gpu/test_layers_gpu.py
