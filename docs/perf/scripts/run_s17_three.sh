# Session 17, call 3 (ONE GPU): the p2p transports at t = 2 with two processes on one GPU (CUDA IPC in place of
# symmetric memory: tests/gpu/peers_on_one_gpu.py); first try (call 3a: torch's symmetric memory refuses two ranks
# on one device, probe_same_gpu_p2p.py) replaced by this.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= OVERLAP_TP_WATCHDOG_S=120
workdir s17_three
step p2p_one_gpu 400 python3 -m pytest -m gpu -q -rA -x $REPO/tests/gpu/test_p2p_one_gpu.py -p no:cacheprovider
grep -E "PASSED|FAILED|passed|failed|Error|error|assert" $W/p2p_one_gpu.out | head -40
