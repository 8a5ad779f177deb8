# Session 13, call 3 (nvidia-h200-x2): the smoke recipe off / signal under full-iteration graphs (the exit fix:
# each must end by itself; 30 s after "after training is done" its workers get SIGABRT), then the faults script
# under full-iteration graphs (issue 24's remaining run).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s13_c
train smoke-off 75 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
train smoke-signal 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py $W/smoke-*/train.log | tee $W/smoke_summary.md
cd $REPO
step faults 300 env COMMIT=${COMMIT:-unknown} OUT=$W/faults WORK=/tmp/s13 SKIP_INSTALL=1 GRAPHS=full_iteration \
  bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
tail -25 $W/faults/summary.md 2>/dev/null
