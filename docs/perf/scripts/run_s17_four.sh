# Session 17, call 4 (ONE GPU): test_p2p_one_gpu.py after the watchdog fix (call 4a, the same two ranks run by hand,
# showed the eager case's watchdog thread dying on the p2p signals' 2-D words: TypeError in _read, then a hang).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= OVERLAP_TP_WATCHDOG_S=120
workdir s17_four
step p2p_one_gpu 400 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_p2p_one_gpu.py -p no:cacheprovider
grep -E "PASSED|FAILED|passed|failed" $W/p2p_one_gpu.out | head -20
