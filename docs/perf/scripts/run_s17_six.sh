# Session 17, call 6 (ONE GPU): every GPU test this session touched, at its last code commit: the p2p transports and
# the TP 2 layers with two processes on one GPU, the dense ops at t = 1 (eager and replayed), the direct launch, the
# expert ops on one GPU, the watchdog tests, the one-GPU layer test, every op replayed at t = 1.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= OVERLAP_TP_WATCHDOG_S=120
workdir s17_six
step gpu_tests 450 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_p2p_one_gpu.py $REPO/tests/gpu/test_ops_one_gpu.py \
  $REPO/tests/gpu/test_direct_launch_gpu.py $REPO/tests/gpu/test_moe_ops_one_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  $REPO/tests/gpu/test_gemm_rs_gpu.py $REPO/tests/gpu/test_layers_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED" $W/gpu_tests.out | tail -6
step graph_replays_t1 100 python3 -c "
import sys; sys.path[:0] = ['$REPO/tests', '$REPO/tests/gpu']
from distributed import run_distributed
from test_graphs_gpu import _check_replays, _check_expert_replays
run_distributed(1, _check_replays, backend='nccl'); print('graph replays at t = 1: passed')
run_distributed(1, _check_expert_replays, backend='nccl'); print('expert graph replays at t = 1: passed')"
tail -2 $W/graph_replays_t1.out
