# Session 23's third call (2 GPUs; ~8 min).
# - issue 25: mixtral-proxy with the overlap on, eager (session 22: off 481.9 ms/iteration; signal did not log its
#   first iteration within 111 s): 200 s, and the workers' stacks at the limit (train() sends SIGABRT 8 s before it).
# - issue 24, the control of session 22's resume finding: the same SIGKILL + torch_dist resume on the path without
#   the overlap (FAULT_OVERLAP=off, eager, deterministic; without TE or Apex the smoke's baseline is overlap_tp's
#   layers with the overlap off: cuBLAS then NCCL): bitwise there or not says whether the 1e-4 drift after a resume
#   comes from the overlapped path; then the SIGSTOP case (STALL=1).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=500
workdir s23_3
export CUDA_VISIBLE_DEVICES=0,1
train mixtral-off 110 OVERLAP=off NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1 -- $REPO/recipes/mixtral-proxy.sh
train mixtral-signal 200 OVERLAP=signal NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1 -- \
  $REPO/recipes/mixtral-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/mixtral-*/train.log | tee $W/mixtral.md
grep -E "Traceback|Error|File \"" $W/mixtral-signal.out | head -40
cd $REPO
step faults_off 170 env STALL=1 FAULT_OVERLAP=off COMMIT=${COMMIT:-unknown} OUT=$W/faults_off WORK=/tmp/s23f \
  SKIP_INSTALL=1 GRAPHS=none FORMATS=torch_dist DETERMINISTIC=1 bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
grep -E "^- |^\| " $W/faults_off/summary.md 2>/dev/null | cut -c1-300
