# Session 17, call 7 (ONE GPU): the expert ops on the new p2p transport (a2a_gemm pulls, gemm_a2a pushes) at EP 2
# with two processes on one GPU, forward and backward against a dense fp32 computation; then the one-GPU expert
# and MoE layer tests (the expert code path changed) and the rest of test_p2p_one_gpu.py.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= OVERLAP_TP_WATCHDOG_S=120
workdir s17_seven
step expert_p2p 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_p2p_one_gpu.py -k expert -p no:cacheprovider
grep -E "PASSED|FAILED|passed|failed|Error|assert" $W/expert_p2p.out | head -20
step one_gpu 300 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py $REPO/tests/gpu/test_p2p_one_gpu.py \
  -k "not expert" -p no:cacheprovider
grep -E "passed|failed|FAILED" $W/one_gpu.out | tail -6
