# If the next session is lent ONE GPU only (sessions 12 and 14-18 were): its first call (nvidia-h100-x1 or
# nvidia-h200; ~8 min), written in session 19 (no GPU). The 2-GPU calls are run_s19_x2_{1,2,3}.sh.
# - session 19's cuBLAS over the p2p transports at t = 2, two processes on one GPU over CUDA IPC (results and
#   protocols, not speed): test_p2p_one_gpu.py whole (its cublas_* cases: eager, replayed with a late peer, the norm
#   summing RegionGemms' slots bitwise, the layer captured fwd + bwd; the soak mixing both methods; the TP 2 layer
#   checks with both methods);
# - every dense op, method and transport at t = 1 against torch, eager and replayed (test_ops_one_gpu.py).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s19_one
step p2p_one_gpu 420 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_p2p_one_gpu.py -p no:cacheprovider \
  --durations=0
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/p2p_one_gpu.out | tail -24
step ops_one_gpu 120 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed" $W/ops_one_gpu.out | tail -3
