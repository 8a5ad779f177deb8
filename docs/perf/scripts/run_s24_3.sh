# The next session's third call (4 GPUs; ~6 min), written in session 23: issue 21's AllGather+GEMM at t = 4, where
# async-TP ends 0.03 ms after its copies and ours 0.10 after (l8b.qkv, session 23): when each chunk lands and when the
# GEMM ends (probe_ag_tail.py), with the default tile and groups, 8 groups, the narrow tile, both; then at t = 2.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=400
workdir s24_3
step ag_tail_t4 120 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_ag_tail.py
grep -E "^t=|Error" $W/ag_tail_t4.out | cut -c1-400
step ag_tail_t2 90 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_ag_tail.py
grep -E "^t=|Error" $W/ag_tail_t2.out | cut -c1-400
# issue 21's remote stores: the plain persistent GEMM with pointer or TMA-store epilogues into local and peer memory
# against cuBLAS (probe_remote_stores.py, t = 2)
step remote_stores 100 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 \
  $REPO/docs/perf/scripts/probe_remote_stores.py
grep -E "us;|remote - local|failed|Error" $W/remote_stores.out | cut -c1-600
