# Session 6, call 5 (nvidia-h200-x8): the layer benchmark at TP = 8 (span, GPU-only and host time) and the
# ag_gemm late-peer test at t = 8 (cut by the previous call's limit).
source .diag/setup_device.sh
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown} CUDA_DEVICE_MAX_CONNECTIONS=1
W=/tmp/w8b; rm -rf $W; mkdir -p $W
pack() { cd $W && tar czf $OUT/s6_x8b.tgz . ; }
trap pack EXIT
timeout 250 torchrun --nproc-per-node 8 -m overlap_tp.bench layer --reps 10 --configs megatron,nocomm,off,signal,signal-agp2p,signal-p2p \
  --out $W --name layer_t8 > $W/layer_t8.log 2>&1; echo "layer t8 exit $?"
grep "^|\|^- l" $W/layer_t8.log
OVERLAP_TP_GPU_WORLD=8 timeout 80 python3 -m pytest -m gpu $REPO/tests/gpu/test_ag_gemm_gpu.py -k late -v -rA --tb=short --timeout 70 \
  --durations=0 -p no:cacheprovider > $W/gpu_tests_t8_late.log 2>&1; echo "== late t8 exit $?"; grep -E "PASSED|FAILED|passed|failed" $W/gpu_tests_t8_late.log | tail -3
