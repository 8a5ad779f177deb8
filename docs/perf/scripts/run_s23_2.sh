# The next session's SECOND call (~9.5 min; 4 GPUs, or 2: the TP 4 runs are skipped), written in session 22.
# - If run_s23_1.sh put the SM pulls ahead at t = 4: llama3-70b-proxy at TP 4 (8 layers, local graphs) off / signal /
#   signal with the AllGathers' pulls on 16 SMs (TRANSPORT=p2p COMM_SMS=16; session 21: off 1019.5, signal 1010.9 ms).
# - issue 24, the control of session 22's resume finding: the same SIGKILL + torch_dist resume on Megatron's own path
#   (FAULT_OVERLAP=off, eager, deterministic; without TE or Apex the smoke's baseline is overlap_tp's layers with the
#   overlap off: cuBLAS then NCCL, no p2p, no signaled GEMM): bitwise there or not says whether the 1e-4 drift after a
#   resume comes from the overlapped path; then the SIGSTOP case (STALL=1) that both of session 22's calls cut.
# - issue 25: mixtral-proxy with the overlap on, eager (session 22: off 481.9 ms/iteration; signal did not log its
#   first iteration within 111 s); a 240 s limit, and stacks at the limit (train() sends SIGABRT 8 s before it).
# - issue 22 (if the time allows): the high-communication proxy layer (mid-size model, NCCL through host memory).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s23_2
T=$(nvidia-smi -L | wc -l)
if (( T >= 4 )); then
  for mode in off signal; do
    train l70b8t4-$mode 110 TP=4 NPROC=4 GRAPHS=local OVERLAP=$mode TRAIN_ITERS=20 GBS=4 -- \
      $REPO/recipes/llama3-70b-proxy.sh
  done
  train l70b8t4-signal-sm16 110 TP=4 NPROC=4 GRAPHS=local OVERLAP=signal TRANSPORT=p2p COMM_SMS=16 TRAIN_ITERS=20 \
    GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
  python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8t4-*/train.log | tee $W/l70b8t4.md
fi
export CUDA_VISIBLE_DEVICES=0,1
cd $REPO
step faults_off 170 env STALL=1 FAULT_OVERLAP=off COMMIT=${COMMIT:-unknown} OUT=$W/faults_off WORK=/tmp/s23f \
  SKIP_INSTALL=1 GRAPHS=none FORMATS=torch_dist DETERMINISTIC=1 bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
grep -E "^- |^\| " $W/faults_off/summary.md 2>/dev/null | cut -c1-300
train mixtral-signal 240 OVERLAP=signal NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1 -- $REPO/recipes/mixtral-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/mixtral-signal/train.log | tee $W/mixtral.md
grep -E "Traceback|Error|File \"" $W/mixtral-signal.out | head -30
# if the time allows, issue 22's high-communication proxy (BENCHMARKS.md): the mid-size layer (h 3072, s 4096) with
# NCCL through host memory (NCCL_P2P_DISABLE=1, ~20 GB/s) and the NCCL transports only (p2p would bypass the proxy)
step layer_mid_proxy 120 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs \
  --models mid --seq 4096 --configs megatron,nocomm,off,signal,decompose --reps 30 --rounds 6 --out $W \
  --name layer_mid_proxy
grep -E "^\| " $W/layer_mid_proxy.md | cut -d'|' -f1-10 | head -8
