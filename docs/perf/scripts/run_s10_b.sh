# Session 10, call 2 (nvidia-h200-x2): end to end with CUDA graphs (issue 21). The smoke recipe with overlap
# off and signal under the same graph mode (local, full_iteration, none), and llama3-8b with 8 layers (local
# graphs), each pair back to back; steady-state ms/iteration and losses side by side. Runs are skipped once
# the call's time runs short (they are listed in priority order).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
W=/tmp/w10b; rm -rf $W; mkdir -p $W
pack() { cd $W && tar czf $OUT/s10_b.tgz --exclude='*/tensorboard' . ; }
trap pack EXIT
cd /tmp   # not the source tree: its overlap_tp/ lacks the installed subpackages (kernels, launch)
run() {   # run NAME SECONDS ENV... -- RECIPE ARGS...
  local name=$1 limit=$2; shift 2
  if (( SECONDS + limit > 570 )); then echo "$name skipped (time)"; return; fi
  local envs=(); while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" OUT_DIR=$W/$name timeout $limit bash "$@" > $W/$name.out 2>&1; echo "$name exit $? at ${SECONDS}s"
  grep -E "Error|error:|Traceback" $W/$name.out | head -3
}
run smoke-local-off 90 GRAPHS=local OVERLAP=off TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
run smoke-local-signal 90 GRAPHS=local OVERLAP=signal TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
run l8b8-local-off 120 GRAPHS=local OVERLAP=off TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh --num-layers 8
run l8b8-local-signal 120 GRAPHS=local OVERLAP=signal TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh --num-layers 8
run smoke-full-off 90 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
run smoke-full-signal 90 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
run smoke-none-signal 90 GRAPHS=none OVERLAP=signal TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
ls $W/*/train.log
python3 $REPO/docs/perf/scripts/summarize_runs.py $W/smoke-*/train.log | tee $W/smoke_summary.md
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b8-*/train.log | tee $W/l8b8_summary.md
