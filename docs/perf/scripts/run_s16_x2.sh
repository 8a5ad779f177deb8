# The next 2-GPU session's SECOND call (nvidia-h200-x2; run_s18_x2.sh first), written in session 16 (one GPU only): what this session
# changed, at t = 2. Then run_s15_b.sh, run_s15_e2e.sh, run_s15_moe.sh, run_s15_a.sh, in that order.
# - GPU tests at t = 2 of the launch path (kernels/launch.py: DirectKernel, JitLauncher) and of the p2p plans'
#   per-call changes (one capture query per call passed to PeerSignals.wait, slot views made at build, ag_gemm's
#   local copy through one view): every op captured and replayed bitwise (with a late peer), gemm_rs / ag_gemm
#   against the sequential path, the direct launch against Triton's JIT;
# - (session 17) the batched stream memory operations (memops.MemOps: counters' waits, flags' lowering, peer
#   signals), NCCL on precomputed addresses, and the layers' copy-engine re-gather (gather_rows) at t = 2 over
#   real NVLink: the same GPU tests, and test_layers_gpu.py (its p2p checks passed at t = 2 with two processes on
#   one GPU in session 17; the NCCL transports only run here);
# - issue 20's host time at t = 2: `bench ops --host` eager (plan, functional API, sequential) on the 8B / 70B shapes.
#   Session 16 at t = 1: gemm_rs p2p 40 us per plan call, ag_gemm 71, gemm_ar 90 (s16/README.md).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s16_x2
step gpu_tests 300 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_graphs_gpu.py $REPO/tests/gpu/test_gemm_rs_gpu.py \
  $REPO/tests/gpu/test_ag_gemm_gpu.py $REPO/tests/gpu/test_direct_launch_gpu.py -p no:cacheprovider --durations=0
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.out | tail -30
step layer_tests 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_layers_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED" $W/layer_tests.out | tail -4
step ops_host 150 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --host --ops rs,ag --seq 8192 --ag-seq 8192 \
  --reps 30 --out $W --name ops_t2_host
grep -E "^\| " $W/ops_t2_host.md
step probe_host 120 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --ab
grep -E "^op=|memop" $W/probe_host.out
