# Session 39, call 2 (2 GPUs, `nvidia-h200-x2`; ~9 min): `COMMIT=<sha> bash docs/perf/scripts/run_s39_x2_2.sh`
# (carry [".whl", ".ab"]; .ab/old: session 38's tree, as for run_s39_x2_1.sh).
# Issue 20, second change: an eager call whose work ends with a join of the comm stream records the watchdog's event
# as the join's (Watched.join; AgGemm's start/finish through its transfers' event): one cuEventRecord fewer per call of
# every NCCL and copy-engine path (ag_gemm p2p 14 -> 13 driver calls, gemm_rs / gemm_ar nccl 10 -> 9).
# 1. GPU tests of those paths: ag_gemm (shapes, 200 calls, late peer), gemm_rs / gemm_ar (every method, async_op, the
#    watchdog), every op replayed bitwise;
# 2. host time: the driver calls removed, issued after each plan call in the same rounds (probe_host_t1.py --removed:
#    their cost on this host, without the host's drift between runs), then session 38's tree against this one.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s39_x2_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
tests ag_gemm 150 $REPO/tests/gpu/test_ag_gemm_gpu.py -k "s8192 or odd or back_to_back or late_peer"
tests gemm_rs 110 $REPO/tests/gpu/test_gemm_rs_gpu.py -k "not auto_runs and not raw_nccl and not s16384"
tests graphs 80 $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays"
P=$REPO/docs/perf/scripts/probe_host_t1.py
CASES="rs p2p,ag p2p,ar nccl,rs nccl"
step host_removed 90 torchrun --nproc-per-node 2 $P --rounds 20 --only "$CASES" --removed --label new
grep -E "^new op=" $W/host_removed.out | cut -c1-600
rm -rf /tmp/old && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old $REPO/.ab/old 2>&1 | tail -1
step host_old 60 env PYTHONPATH=/tmp/old:/tmp/site torchrun --nproc-per-node 2 $P --rounds 10 --only "$CASES" --label old
grep -E "^old op=" $W/host_old.out | cut -c1-420
step host_new 60 torchrun --nproc-per-node 2 $P --rounds 10 --only "$CASES" --label new
grep -E "^new op=" $W/host_new.out | cut -c1-420
