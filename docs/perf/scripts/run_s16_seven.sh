# Session 16, call 7 (ONE GPU): the p2p plan calls ask once per call whether the stream is captured, read
# precomputed slot views, check only what a call can change; ag_gemm copies its shard through one narrow view.
# Tests: the one-GPU plan and layer tests, the direct-launch file, and the every-op graph-replay test run at t = 1
# (its pytest form needs 2 GPUs: called directly here, one rank). Then the plan calls' host time (probe_host_t1 --ab).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_seven
step gpu_tests 240 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_tile_rule_gpu.py \
  $REPO/tests/gpu/test_layers_gpu.py $REPO/tests/gpu/test_direct_launch_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -8
step graph_replays_t1 200 python3 -c "
import sys; sys.path[:0] = ['$REPO/tests', '$REPO/tests/gpu']
from distributed import run_distributed
from test_graphs_gpu import _check_replays
run_distributed(1, _check_replays, backend='nccl'); print('graph replays at t = 1: passed')"
tail -3 $W/graph_replays_t1.out
step probe_host_t1 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_host_t1.py --ab
grep -E "^op=|memop" $W/probe_host_t1.out
