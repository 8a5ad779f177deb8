# Session 41, call 2 (2 GPUs, `nvidia-h200-x2`; ~8 min): `COMMIT=<sha> bash docs/perf/scripts/run_s41_x2_2.sh`
# (carry [".whl"]). Issue 20: gemm_ar's p2p transport (ops/p2p.py P2PAllReduce: the p2p ReduceScatter, its sum into
# this rank's region of a symmetric buffer, the copy engines' pulls of the peers' regions), replayed from graphs.
# 1. GPU tests: the replays (gemm_ar's with them), gemm_ar at its shapes (p2p bit for bit the NCCL signal path at
#    t = 2), 200 calls with a bias, async_op;
# 2. host time per call (24 after 8 warm) with a twin without replays: predicted gemm_ar p2p ~20 us (one graph
#    launch, as gemm_rs p2p's 15.6 in call 1 plus a larger output), its eager twin ~45;
# 3. `bench ops` for gemm_ar with its p2p variants, eager (--host) and graph-captured: predicted p2p ~0.29 ms at
#    l8b.proj s 8192 (gemm_rs p2p's 0.237 + a 16 MB pull at ~350 GB/s) against seq 0.433 and the NCCL signal 0.471.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s41_x2_2
tests replay 150 $REPO/tests/gpu/test_replay_gpu.py
tests gemm_ar 150 $REPO/tests/gpu/test_gemm_rs_gpu.py -k "gemm_ar or 200_back_to_back or async_op"
step host 100 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10 --warm 8 --burst 24 \
  --only "ar p2p,ar nccl" --eager
grep -E "^t = |^op=" $W/host.out | cut -c1-700
step ar_eager 80 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops ar --shapes l8b.proj,l70b.proj \
  --ar-seq 8192 --host --reps 20 --out $W --name ar_eager_t2
grep -E "^\|" $W/ar_eager_t2.md | cut -c1-600
step ar_graphs 80 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops ar --shapes l8b.proj,l70b.proj \
  --ar-seq 8192 --graphs --reps 20 --out $W --name ar_graphs_t2
grep -E "^\|" $W/ar_graphs_t2.md | cut -c1-600
grep -h '"variants"' -A6 $W/ar_*_t2.json | head -30
