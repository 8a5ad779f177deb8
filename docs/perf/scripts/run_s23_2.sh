# The next session's SECOND call (~9.5 min; 4 GPUs, or 2: the TP 4 runs are skipped), written in session 22.
# - What the remote epilogue stores cost (probe_remote_epilogue.py): the signaled GEMM and cuBLAS storing into local
#   memory and into the peer's, and the p2p ReduceScatter ops, at the 8B layer's four shapes (t = 2).
# - If run_s23_1.sh put the SM pulls ahead at t = 4: llama3-70b-proxy at TP 4 (8 layers, local graphs) off / signal /
#   signal with the AllGathers' pulls on 16 SMs (TRANSPORT=p2p COMM_SMS=16; session 21: off 1019.5, signal 1010.9 ms).
# - issue 24, the control of session 22's resume finding: the same SIGKILL + torch_dist resume on Megatron's own path
#   (FAULT_OVERLAP=off, eager, deterministic; without TE or Apex the smoke's baseline is overlap_tp's layers with the
#   overlap off: cuBLAS then NCCL, no p2p, no signaled GEMM): bitwise there or not says whether the 1e-4 drift after a
#   resume comes from the overlapped path; then the SIGSTOP case (STALL=1) that both of session 22's calls cut.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s23_2
T=$(nvidia-smi -L | wc -l)
# the ReduceScatters' remote epilogue stores (issue 21: two thirds of the signaled GEMMs' excess in the 8B step):
# signaled vs cuBLAS, local vs into the peer, and the p2p ops, at the 8B shapes, t = 2
step remote_epilogue 100 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 \
  $REPO/docs/perf/scripts/probe_remote_epilogue.py
grep -E "us;|remote - local|Error" $W/remote_epilogue.out | cut -c1-600
if (( T >= 4 )); then
  for mode in off signal; do
    train l70b8t4-$mode 95 TP=4 NPROC=4 GRAPHS=local OVERLAP=$mode TRAIN_ITERS=16 GBS=4 -- \
      $REPO/recipes/llama3-70b-proxy.sh
  done
  train l70b8t4-signal-sm16 95 TP=4 NPROC=4 GRAPHS=local OVERLAP=signal TRANSPORT=p2p COMM_SMS=16 TRAIN_ITERS=16 \
    GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
  python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8t4-*/train.log | tee $W/l70b8t4.md
fi
export CUDA_VISIBLE_DEVICES=0,1
cd $REPO
step faults_off 170 env STALL=1 FAULT_OVERLAP=off COMMIT=${COMMIT:-unknown} OUT=$W/faults_off WORK=/tmp/s23f \
  SKIP_INSTALL=1 GRAPHS=none FORMATS=torch_dist DETERMINISTIC=1 bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
grep -E "^- |^\| " $W/faults_off/summary.md 2>/dev/null | cut -c1-300
