# The next session's first call (2 GPUs; ~9.5 min), written in session 26. Pass the commit as a literal:
# `COMMIT=<sha> bash docs/perf/scripts/run_s27_1.sh` (on the device `git rev-parse` read stale metadata in s26).
# 0. Issue 20's host time per plan call at t = 2 on the H200 pair (after session 23's hot-path changes it was
#    measured on H100 hosts only, where a bare torch.mm took 63-70 us of host time).
# 1. Issue 22: the AllGather+GEMM over NCCL sends and receives each chunk (4aa44be; before, one broadcast per root,
#    run one after the other): its GPU tests, then the mid layer at the proxy (s26: signal 0.999 of Megatron's;
#    predicted ~0.86: the forward AllGathers' 1.99 ms -> ~1.0 per step), and the broadcasts' tree beside it.
# 2. Issue 25's Zipf figure at the proxy (s26: 1.145x, target 1.15x): the expert ops with 2 comm SMs, which bench
#    moe's sweep found best on every proxy row (s26/moe_ops_proxy.md) and the layer sweep never tried; predicted
#    ~0.7 ms of 47.8 per layer step (Zipf ~1.16x). The first pass names the kernels a new routing compiles
#    and counts its device allocations (s26: signal 448 ms per step on Zipf, 48 warm; which of the two is it?).
#    (The expert ops' exchanges were sends and receives already: not changed by 4aa44be.)
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s27_1
export CUDA_VISIBLE_DEVICES=0,1
step host_t2 60 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10
grep -v "^W1\|^\*\|Warning\|warn" $W/host_t2.out | head -30 | cut -c1-250
step ag_nccl_tests 120 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_ag_gemm_gpu.py \
  $REPO/tests/gpu/test_graphs_gpu.py -k "s8192 or odd or late_peer or back_to_back or every_op_replays" -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/ag_nccl_tests.out | grep -v "^\.\./" | cut -c1-200 | tail -12
step mid_proxy 110 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models mid \
  --seq 4096 --configs megatron,nocomm,signal,decompose --reps 20 --rounds 4 --out $W --name layer_mid_proxy
grep -E "^\| mid " $W/layer_mid_proxy.md | cut -c1-200
# the same with the broadcasts (the tree before 4aa44be, carried as .ab/old: `mkdir -p .ab/old && git archive
# 4aa44be~1 | tar -x -C .ab/old`, run with carry [".whl", ".ab"]): signal / megatron of both runs side by side
if [[ -d $REPO/.ab/old ]]; then
  rm -rf /tmp/old && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old $REPO/.ab/old 2>&1 | tail -1
  step mid_proxy_old 100 env PYTHONPATH=/tmp/old:/tmp/site NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 \
    -m overlap_tp.bench layer --graphs --models mid --seq 4096 --configs megatron,signal --reps 20 --rounds 4 \
    --out $W --name layer_mid_proxy_old
  grep -E "^\| mid " $W/layer_mid_proxy_old.md | cut -c1-200
fi
V=signal,signal.sm2,signal.g4.sm2,signal.g8.sm2,off
step moe_proxy_sm2 170 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --routing zipf,uniform --methods $V --reps 32 --rounds 8 --out $W --name moe_layer_proxy_sm2
grep -E "^\| " $W/moe_layer_proxy_sm2.md | cut -c1-500
