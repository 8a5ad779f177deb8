# Session 16, call 12 (ONE GPU): the one-GPU GPU tests at the session's last code commit: the direct launch, the
# expert ops, the fused norm, the tile rule, the layers' one-GPU tests, and every op captured and replayed at t = 1.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_twelve
step gpu_tests 420 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_direct_launch_gpu.py \
  $REPO/tests/gpu/test_moe_ops_one_gpu.py $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py \
  $REPO/tests/gpu/test_tile_rule_gpu.py $REPO/tests/gpu/test_layers_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -8
step graph_replays_t1 120 python3 -c "
import sys; sys.path[:0] = ['$REPO/tests', '$REPO/tests/gpu']
from distributed import run_distributed
from test_graphs_gpu import _check_replays
run_distributed(1, _check_replays, backend='nccl'); print('graph replays at t = 1: passed')"
tail -2 $W/graph_replays_t1.out
