# Session 6, call 3 (nvidia-h200-x4): llama3-8b and llama3-70b-proxy (TP 2) with --overlap-tp signal at the
# new default transport (auto: ag_gemm p2p) vs off, side by side; then the layer benchmark (fixed GPU-only
# column) on GPUs 0-1 while the GPU tests of the changed paths run on GPUs 2-3.
source .diag/setup_device.sh
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
pair() {  # recipe timeout_s env...
  local recipe=$1 limit=$2; shift 2
  (env "$@" CUDA_VISIBLE_DEVICES=0,1 OVERLAP=signal MASTER_PORT=29500 OUT_DIR=$OUT/$recipe-signal \
     timeout $limit bash $REPO/recipes/$recipe.sh > /dev/null 2>$OUT/$recipe-signal.err; echo "== $recipe signal exit $?") &
  (env "$@" CUDA_VISIBLE_DEVICES=2,3 OVERLAP=off MASTER_PORT=29600 OUT_DIR=$OUT/$recipe-off \
     timeout $limit bash $REPO/recipes/$recipe.sh > /dev/null 2>$OUT/$recipe-off.err; echo "== $recipe off exit $?") &
  wait
  for m in signal off; do
    local log=$OUT/$recipe-$m/train.log
    echo "-- $recipe $m"; tail -2 $OUT/$recipe-$m.err
    grep "\[overlap_tp\] layers on" $log | head -1; grep "\[overlap_tp\]" $log | tail -1
    grep -E " iteration +[0-9]+/" $log | tail -1 | tr '|' '\n' | grep -E "lm loss|elapsed|throughput"
    grep -iE "Error|Traceback" $log | head -3
  done
  python3 -m overlap_tp.report $OUT/$recipe-off/train.log $OUT/$recipe-signal/train.log --out $OUT/$recipe-report 2>&1 | tail -6
}
pair llama3-8b 200 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=2 WANDB_PROJECT=
pair llama3-70b-proxy 200 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=2 NUM_LAYERS=8 WANDB_PROJECT=
export CUDA_DEVICE_MAX_CONNECTIONS=1
(CUDA_VISIBLE_DEVICES=2,3 OVERLAP_TP_GPU_WORLD=2 timeout 170 python3 -m pytest -m gpu $REPO/tests/gpu/test_gemm_rs_gpu.py $REPO/tests/gpu/test_ag_gemm_gpu.py \
   -k "s8192 or gemm_ar or back_to_back or async or raw_nccl or late" -v -rA --tb=short --timeout 120 --durations=0 -p no:cacheprovider > $OUT/gpu_tests_t2.log 2>&1
 echo "== gpu tests exit $?: $(grep -cE '::.* PASSED' $OUT/gpu_tests_t2.log) passed"; grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" $OUT/gpu_tests_t2.log | tail -4) &
CUDA_VISIBLE_DEVICES=0,1 timeout 200 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --reps 20 \
  --configs megatron,nocomm,off,signal,signal-agp2p,signal-p2p --out $OUT --name layer_t2_gpu > $OUT/layer_t2.log 2>&1; echo "layer t2 exit $?"
grep "^|\|^- l" $OUT/layer_t2.log
wait
cd $OUT && tar czf /tmp/s6_c.tgz . && mv /tmp/s6_c.tgz $OUT/
