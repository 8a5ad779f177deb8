# Session 17, call 10 (ONE GPU): the session's last code, whole: test_p2p_one_gpu.py (two processes on one GPU: the
# dense p2p ops, the layers, the watchdog, the expert ops and the MoE layer on p2p), and `bench moe_layer` with the
# new signal-p2p variant at EP 1 (a run-through of the option, not a timing that says anything about EP 2).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= OVERLAP_TP_WATCHDOG_S=120
workdir s17_ten
step p2p_one_gpu 360 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_p2p_one_gpu.py -p no:cacheprovider
grep -E "PASSED|FAILED|passed|failed" $W/p2p_one_gpu.out | head -24
step moe_bench 100 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --tokens 4096 --routing zipf --routings 2 \
  --methods signal,signal-p2p,off --reps 6 --rounds 2 --out $W --name moe_layer_ep1_p2p
grep -E "^\| " $W/moe_layer_ep1_p2p.md | head -4
