# Session 40, call 5 (2 GPUs, `nvidia-h200-x2`; ~7 min): `COMMIT=<sha> bash docs/perf/scripts/run_s40_x2_5.sh`
# (carry [".whl"]). Issue 20: the plans' GEMM and sum launched through launch_checked (SignaledGemm: the launch's
# arguments kept by the tensors' addresses; SumSlots: made once per slots buffer).
# 1. GPU tests: the direct launches (the new launch_checked tests with them), gemm_rs / gemm_ar / ag_gemm, every op
#    replayed bitwise, the p2p ops on one GPU, the 10,000-call soak;
# 2. host time per call in runs of calls (24 after 8 warm), the plan against itself with the launches as before
#    (--unbound) in the same rounds: predicted -4 to -5 us per gemm_rs p2p call (its GEMM's Python ~4.6 -> ~1.5 us,
#    its sum's ~2.7 -> ~1), -3 us per ag_gemm p2p / gemm_ar nccl call (the GEMM only);
# 3. `bench ops --host` (tune.timing.enqueue_us) at the l8b shapes.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s40_x2_5
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
tests direct 80 $REPO/tests/gpu/test_direct_launch_gpu.py
tests gemm_rs 110 $REPO/tests/gpu/test_gemm_rs_gpu.py -k "not auto_runs and not raw_nccl and not watchdog"
tests ag_gemm 80 $REPO/tests/gpu/test_ag_gemm_gpu.py
tests graphs 60 $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays"
tests one_gpu 70 $REPO/tests/gpu/test_p2p_one_gpu.py -k "test_p2p_transports_at_t2"
step host 100 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10 --warm 8 --burst 24 \
  --only "rs p2p,ag p2p,ar nccl,rs nccl" --unbound
grep -E "^t = |^op=" $W/host.out | cut -c1-600
tests soak 60 $REPO/tests/gpu/test_soak_gpu.py
step ops_host 90 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops rs,ar,ag --shapes l8b.proj \
  --ag-shapes l8b.qkv --seq 8192 --ag-seq 8192 --ar-seq 8192 --host --reps 20 --out $W --name ops_host_t2
grep -E "^\|" $W/ops_host_t2.md | cut -c1-600
