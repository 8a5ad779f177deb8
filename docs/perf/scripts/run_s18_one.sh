# Session 18, call 1 (ONE GPU): session 17's last code (the review commit) on the GPU: test_p2p_one_gpu.py whole
# (two processes on one GPU, the p2p transports at t = 2), then the plans' host time per call at t = 2 for the p2p
# transports (probe_host_t1.py --one-gpu: two ranks on one GPU over CUDA IPC; the host's side only).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= OVERLAP_TP_WATCHDOG_S=120
workdir s18_one
step p2p_one_gpu 400 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_p2p_one_gpu.py -p no:cacheprovider
grep -E "PASSED|FAILED|passed|failed" $W/p2p_one_gpu.out | head -24
step host_t2 150 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --one-gpu --rounds 20
cat $W/host_t2.out | grep -v "^W1\|^\*\*\*\|OMP" | head -20
