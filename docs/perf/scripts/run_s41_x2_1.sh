# Session 41, call 1 (2 GPUs, `nvidia-h200-x2`; ~8 min): `COMMIT=<sha> bash docs/perf/scripts/run_s41_x2_1.sh`
# (carry [".whl"]). Issue 20: the p2p plans' eager calls replayed from CUDA graphs captured per operand addresses
# (ops/replay.py).
# 1. GPU tests: the replays against twin plans that issue eagerly (new), then the p2p ops' tests that now run through
#    replays (gemm_rs 200 calls / async_op, ag_gemm shapes / 200 calls / late peer), the direct launches (session
#    40's review commit, not run on GPUs);
# 2. host time per call in runs of calls (24 after 8 warm), the plan against a twin without replays (--eager) in the
#    same rounds: predicted gemm_rs p2p 42 -> ~20 us at a slow turn (one graph launch, an event record, the output's
#    allocation and check_call left), ag_gemm p2p 97 -> ~22, gemm_ar nccl unchanged (no replays over NCCL);
# 3. `bench ops --host` at the l8b shapes.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s41_x2_1
tests replay 150 $REPO/tests/gpu/test_replay_gpu.py
step host 120 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10 --warm 8 --burst 24 \
  --only "rs p2p,ag p2p,ar nccl" --eager
grep -E "^t = |^op=" $W/host.out | cut -c1-700
step ops_host 90 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops rs,ar,ag --shapes l8b.proj \
  --ag-shapes l8b.qkv --seq 8192 --ag-seq 8192 --ar-seq 8192 --host --reps 20 --out $W --name ops_host_t2
grep -E "^\|" $W/ops_host_t2.md | cut -c1-600
tests gemm_rs 80 $REPO/tests/gpu/test_gemm_rs_gpu.py -k "200_back_to_back or async_op"
tests ag_gemm 120 $REPO/tests/gpu/test_ag_gemm_gpu.py
tests direct 80 $REPO/tests/gpu/test_direct_launch_gpu.py
