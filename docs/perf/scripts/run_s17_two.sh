# Session 17, call 2 (ONE GPU): where a plan call's host time goes after call 1's changes (cProfile, us per call),
# and the MoE layer's GPU tests at EP 1 (parity with Megatron's MoELayer, recompute, static sizes captured).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s17_two
step probe_profile 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 8 --profile --label s17
grep -v "^\[" $W/probe_profile.out | grep -v Warning | head -150
step moe_layer_ep1 330 python3 -c "
import sys; sys.path[:0] = ['$REPO/tests', '$REPO/tests/gpu']
import test_moe_layer_gpu as T
from distributed import run_distributed
for routing in ('uniform', 'zipf'):
    run_distributed(1, T._check_parity, routing, T.TOKENS, {}, backend='nccl'); print('parity EP 1', routing, 'passed', flush=True)
run_distributed(1, T._check_parity, 'zipf', 2048, dict(hidden=1024, ffn=2048, recompute_granularity='selective',
                recompute_modules=['moe']), backend='nccl'); print('parity EP 1 recomputed passed', flush=True)
run_distributed(1, T._check_captured, backend='nccl'); print('captured EP 1 passed', flush=True)
run_distributed(1, T._check_back_to_back, backend='nccl'); print('200 steps EP 1 passed', flush=True)
"
grep -E "passed|Error|error" $W/moe_layer_ep1.out | tail -12
