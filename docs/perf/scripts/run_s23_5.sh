# Session 23's fifth call (2 GPUs; ~3.5 min, the session's last device time): the host-time changes of issue 20 (every
# op's hot path: memops, ag_gemm's runners and listed pulls / broadcasts by address, gemm_rs / gemm_ar without
# Pending) against the GPU tests at t = 2 (ag_gemm and gemm_rs / gemm_ar at the bench shapes, the late peer, graph
# replays bitwise equal to eager), then the plans' host time at t = 2 (probe_host_t1.py, rank 0 prints).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=190
workdir s23_5
export CUDA_VISIBLE_DEVICES=0,1
step hot_path_tests 130 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_ag_gemm_gpu.py \
  $REPO/tests/gpu/test_gemm_rs_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  -k "s8192 or odd or late_peer or test_gemm_ar or every_op_replays or async_op" -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/hot_path_tests.out | grep -v "^\.\./" | cut -c1-300 | tail -12
step host_t2 55 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10
grep -v "^W1\|^\*\|Warning\|warn" $W/host_t2.out | head -30 | cut -c1-250
