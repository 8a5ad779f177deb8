# Session 10, call 3 (nvidia-h200-x2): the MoE op and layer GPU tests after the expert ops' new synchronisation,
# then end to end with local CUDA graphs: llama3-70b-proxy (8 layers) and llama3-8b (32 layers), off and
# signal back to back. Runs are skipped once the call's time runs short (priority order).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
W=/tmp/w10c; rm -rf $W; mkdir -p $W
pack() { cd $W && tar czf $OUT/s10_c.tgz --exclude='*/tensorboard' . ; }
trap pack EXIT
timeout 150 python3 -m pytest -m gpu -q -x $REPO/tests/gpu/test_moe_ops_gpu.py -rA > $W/gpu_tests_moe_ops.log 2>&1; echo "moe ops tests exit $?"
grep -E "passed|failed|Error" $W/gpu_tests_moe_ops.log | tail -4
timeout 100 python3 -m pytest -m gpu -q -x $REPO/tests/gpu/test_layers_gpu.py -rA > $W/gpu_tests_layers.log 2>&1; echo "layer tests exit $?"
grep -E "passed|failed|Error" $W/gpu_tests_layers.log | tail -4
cd /tmp   # not the source tree: its overlap_tp/ lacks the installed subpackages (kernels, launch)
run() {   # run NAME SECONDS ENV... -- RECIPE ARGS...
  local name=$1 limit=$2; shift 2
  if (( SECONDS + limit > 580 )); then echo "$name skipped (time)"; return; fi
  local envs=(); while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" OUT_DIR=$W/$name timeout $limit bash "$@" > $W/$name.out 2>&1; echo "$name exit $? at ${SECONDS}s"
  grep -E "Error|error:|Traceback" $W/$name.out | head -3
}
run l70b8-local-off 120 GRAPHS=local OVERLAP=off TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
run l70b8-local-signal 120 GRAPHS=local OVERLAP=signal TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
run l8b32-local-off 140 GRAPHS=local OVERLAP=off TRAIN_ITERS=20 GBS=2 -- $REPO/recipes/llama3-8b.sh
run l8b32-local-signal 140 GRAPHS=local OVERLAP=signal TRAIN_ITERS=20 GBS=2 -- $REPO/recipes/llama3-8b.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8-*/train.log | tee $W/l70b8_summary.md
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b32-*/train.log | tee $W/l8b32_summary.md
