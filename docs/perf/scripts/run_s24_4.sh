# Session 24's third call (2 GPUs; ~8.5 min). Four-GPU kinds were not lent, so run_s24_3.sh's t = 4 parts wait.
# - Issue 25: the MoE layer's GPU tests at EP 2 (against Megatron's MoE layer, recomputed, 200 steps, graphs), then
#   the ops' late-peer test alone with more time (run_s24_2 cut it at its step limit with no worker stacks: slow or
#   stuck is what this decides; it sleeps 2 s per config and the watchdog is 120 s).
# - Issue 21: probe_ag_tail.py at t = 2 (chunk landings against the GEMM's end) and probe_remote_stores.py (pointer
#   and TMA-store epilogues into local and peer memory against cuBLAS).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=540
workdir s24_4
export CUDA_VISIBLE_DEVICES=0,1
step moe_layer 150 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_moe_layer_gpu.py -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/moe_layer.out | grep -v "^\.\./" | cut -c1-300 | tail -8
step late_peer 170 python3 -m pytest -m gpu -v -rA -s --tb=short $REPO/tests/gpu/test_moe_ops_gpu.py -k late_peer \
  --durations=0 -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed|call " $W/late_peer.out | grep -v "^\.\./" | cut -c1-300 | tail -6
step ag_tail_t2 90 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_ag_tail.py
grep -E "^t=|Error" $W/ag_tail_t2.out | cut -c1-400
step remote_stores 100 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_remote_stores.py
grep -E "us;|remote - local|failed|Error" $W/remote_stores.out | cut -c1-600
