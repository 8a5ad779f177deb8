# A later 2-GPU call (after run_s19_x2_{1,2,3}.sh and run_s15_moe.sh; nvidia-h200-x2), written at the end of session 13 for what its device time did
# not cover (session 14 had one GPU only: it ran nothing of this):
# - the expert ops' and the AllGather+GEMM's GPU tests after 2a6c592 (the GEMM enqueued before the transfers):
#   session 13's run reached only the expert ops' four cases before its step limit (fresh machine, cold Triton
#   cache); 200 back-to-back calls and the late peers, both AG transports, did not run;
# - AllGather+GEMM eager (the order matters only eagerly: a graph keeps dependencies): S eager against session
#   10's 1.25 / 1.03 / 1.11 / 1.01 (s10/ops_t2_eager.md); and the decompose column after its single fork
#   (8e82031: in session 13 decompose was slower than sequential on all four AG shapes);
# - the faults script's torch_dist case under full-iteration graphs, which outlived its limit in session 13
#   (since then a process a rank spawns ends with the rank: launch/orphans.py, the suspected cause):
#   the script now records the job's processes and their stacks (<job>_stuck.txt, SIGABRT with faulthandler);
#   with DETERMINISTIC=1 (Megatron's --deterministic-mode, under which SDPAttention now runs SDPA's math kernel,
#   session 13) the resumed run can be compared bit for bit with the uninterrupted one (issue 24, item 4).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s15_a
step gpu_tests 280 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_gpu.py $REPO/tests/gpu/test_ag_gemm_gpu.py \
  -p no:cacheprovider --durations=0
grep -E "^(PASSED|FAILED|ERROR)|passed|failed|s call" $W/gpu_tests.out | tail -30
step ops_ag_eager 90 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --host --ops ag --ag-seq 8192 --reps 30 \
  --out $W --name ops_ag_eager
grep -E "^\| ag" $W/ops_ag_eager.md
cd $REPO
step faults 200 env COMMIT=${COMMIT:-unknown} OUT=$W/faults WORK=/tmp/s15 SKIP_INSTALL=1 GRAPHS=full_iteration \
  FORMATS=torch_dist DETERMINISTIC=1 bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
tail -12 $W/faults/summary.md 2>/dev/null; cat $W/faults/*_stuck.txt 2>/dev/null
