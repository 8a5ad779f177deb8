# The next session's third call (4 GPUs; ~7.5 min), written in session 23: issue 21's AllGather+GEMM at t = 4, where
# async-TP ends 0.03 ms after its copies and ours 0.10 after (l8b.qkv, session 23): when each chunk lands and when the
# GEMM ends (probe_ag_tail.py), with the default tile and groups, 8 groups, the narrow tile, both; then at t = 2.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=520
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
# the GEMM+AllReduce test at t = 4 after its sequential twin's fix (it now runs the op's tile: session 23 README)
step gemm_ar_t4 100 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_gemm_rs_gpu.py -k test_gemm_ar \
  -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/gemm_ar_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -4
