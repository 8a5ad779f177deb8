# Session 17, call 1 (ONE GPU): the batched stream memory operations, the raw NCCL calls on addresses and the
# driver copy of ag_gemm's local shard (issue 20): the one-GPU GPU tests, then the plan calls' host time, this
# commit against session 16's code (3fbc499, carried as .ab/old) run one after the other, twice (A B A B), each
# with its own bare-cuBLAS baseline in the same rounds.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s17_one
step gpu_tests 300 python3 -m pytest -m gpu -q -rA -x $REPO/tests/gpu/test_ops_one_gpu.py \
  $REPO/tests/gpu/test_direct_launch_gpu.py $REPO/tests/gpu/test_moe_ops_one_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  $REPO/tests/gpu/test_gemm_rs_gpu.py $REPO/tests/gpu/test_ag_gemm_gpu.py $REPO/tests/gpu/test_layers_gpu.py \
  -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -8
step graph_replays_t1 120 python3 -c "
import sys; sys.path[:0] = ['$REPO/tests', '$REPO/tests/gpu']
from distributed import run_distributed
from test_graphs_gpu import _check_replays, _check_expert_replays
run_distributed(1, _check_replays, backend='nccl'); print('graph replays at t = 1: passed')
run_distributed(1, _check_expert_replays, backend='nccl'); print('expert graph replays at t = 1: passed')"
tail -3 $W/graph_replays_t1.out
for pass in 1 2; do
  step probe_old_$pass 100 env PYTHONPATH=$REPO/.ab/old:/tmp/site torchrun --nproc-per-node 1 \
    $REPO/docs/perf/scripts/probe_host_t1.py --rounds 20 --label s16
  step probe_new_$pass 100 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 20 --label s17
done
grep -h -E "^s1[67] " $W/probe_*.out
