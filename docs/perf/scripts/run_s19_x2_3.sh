# The next 2-GPU session's THIRD call (after run_s19_x2_2.sh; ~9.5 min), written in session 19 (no GPU).
# - llama3-70b-proxy, 8 layers (local graphs): off, signal (session 10: 1.001x; the layer bench at 0.985 of
#   Megatron's in s13 against a 0.971 counterfactual);
# - the p2p plans' host time at t = 2 on two GPUs (issue 20: <= 40 us per plan call, <= 60 us through the API), the
#   cuBLAS-over-p2p plans next to them;
# - the ops under graphs at the 8B / 70B shapes, s 8192: sequential, ours (signal-p2p), nccl and cuBLAS over p2p
#   (decompose-p2p), each against the sequential path's output before timing;
# - the op-level GPU tests at t = 2 (the gathered buffer per shape, graph replays with a late peer, gemm_rs's
#   methods and transports, the direct launch), as far as the time allows.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s19_x2_3
train l70b8-off 120 GRAPHS=local OVERLAP=off TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
train l70b8-signal 120 GRAPHS=local OVERLAP=signal TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8-*/train.log | tee $W/l70b8.md
step probe_host 90 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 20
grep -E "^op=|memop" $W/probe_host.out
step ops_graphs 130 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops rs,ag --seq 8192 --ag-seq 8192 \
  --reps 30 --out $W --name ops_t2_graphs
grep -E "^\| " $W/ops_t2_graphs.md
step op_tests 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_ag_gemm_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  $REPO/tests/gpu/test_gemm_rs_gpu.py $REPO/tests/gpu/test_direct_launch_gpu.py -p no:cacheprovider
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/op_tests.out | tail -24
