# The next session's first call (2 GPUs; ~8.5 min), written in session 23.
# - The graph-replay test that session 23's last call cut for time: issue 20's hot-path changes (merged in session 23:
#   memops, ag_gemm's runners, listed pulls, broadcasts by address, gemm_rs / gemm_ar without Pending) passed 7 GPU
#   tests at t = 2 there, not yet this one (every op captured and replayed bitwise equal to eager).
# - Issue 21: which tile closes the signaled GEMM's long-K gap to cuBLAS (probe_long_k.py, one GPU).
# - Issue 24, the control of session 22's resume finding (resumed runs equal at their first iteration, ~1e-4 off from
#   the second): SIGKILL + torch_dist resume with the overlap off (eager, deterministic; session 23 ran the reference
#   and the kill, 5.1 s to torchrun's failure line, then its time ran out), then the SIGSTOP case (STALL=1). Session 23
#   found and patched one such cause in megatron-core (torch AdamW's step shared by every parameter after a
#   distributed-optimizer load: launch/pretrain.py separate_adam_steps), but the smoke recipe these faults run does
#   not use the distributed optimizer (its step is restored per parameter), so the control still decides.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=560
workdir s24_1
export CUDA_VISIBLE_DEVICES=0,1
step graphs_t2 90 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_graphs_gpu.py \
  -k "every_op_replays or unbuilt_plan" -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/graphs_t2.out | grep -v "^\.\./" | cut -c1-300 | tail -4
step long_k 150 env CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_long_k.py
grep -E "us \(|skipped|Error" $W/long_k.out | cut -c1-700
cd $REPO
step faults_off 300 env STALL=1 FAULT_OVERLAP=off COMMIT=${COMMIT:-unknown} OUT=$W/faults_off WORK=/tmp/s24f \
  SKIP_INSTALL=1 GRAPHS=none FORMATS=torch_dist DETERMINISTIC=1 bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
grep -E "^- |^\| " $W/faults_off/summary.md 2>/dev/null | cut -c1-300
