# The next session's FIRST call (~9.5 min), written in session 22; 4 GPUs (t = 2 runs on GPUs 0-1), or 2 (the t = 4
# steps are skipped).
# Session 22 found the copy engines at 210-270 GB/s per rank however driven, while PyTorch's async-TP (copies:
# `copy_` of peer-mapped views) ran the 8B qkv AllGather+GEMM at t = 4 in 0.218 ms against ours 0.310. Built then,
# not yet run on GPUs: the p2p AllGather's pulls as a kernel on comm_sms SMs (kernels/peer_copy.py; ag_gemm signal
# over p2p with comm_sms > 0). Here, in order:
# - the probe: copy engines, torch copy_, the SM pull kernel (programs x BLOCK), eager and in a CUDA graph, alone and
#   beside a GEMM, at t = 4 and t = 2 (decides whether the SM pulls can beat the ceiling, and which size);
# - the SM pulls' GPU tests: the kernel alone against its reference (one GPU), then at t = 2 ag_gemm every shape
#   bitwise against the same kernel after a full gather, a late peer, 200 graph replays with a late peer, then at
#   t = 4 the shapes and the late peer;
# - the AllGather+GEMM at t = 4 and t = 2 under graphs: ours (copy engines) against p2p/sm16, p2p/sm32, async-TP;
# - the layer at t = 4: signal-p2p against signal-p2p-sm16 (8B: 1.15x its counterfactual in session 21).
# Prediction (t = 4, l8b.qkv): if the SM pulls move >= 400 GB/s on 16-32 SMs, the op goes from 0.31 to ~0.22-0.24 ms
# (the GEMM on 100-116 SMs: 0.137 -> ~0.16 ms, the pulls 0.19 -> ~0.12); the 8B layer from 0.964 toward ~0.92.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s23_1
T=$(nvidia-smi -L | wc -l)
if (( T >= 4 )); then
  step copies_t4 100 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_ce_copies.py
  grep -E "^t=|checked|Error" $W/copies_t4.out | cut -c1-700
fi
step copies_t2 80 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_ce_copies.py
grep -E "^t=|checked|Error" $W/copies_t2.out | cut -c1-700
step sm_pull_tests_t2 130 env CUDA_VISIBLE_DEVICES=0,1 python3 -m pytest -m gpu -v -rA --tb=short \
  $REPO/tests/gpu/test_peer_copy_gpu.py $REPO/tests/gpu/test_ag_gemm_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  -k "peer_copy or s8192 or odd or late_peer or every_op_replays" -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/sm_pull_tests_t2.out | grep -v "^\.\./" | cut -c1-300 | tail -8
if (( T >= 4 )); then
  step sm_pull_tests_t4 100 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_ag_gemm_gpu.py \
    -k "s8192 or late_peer" -p no:cacheprovider
  grep -E "PASSED|FAILED|ERROR|passed|failed" $W/sm_pull_tests_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -6
  step ops_ag_t4 70 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops ag --ag-seq 8192 --reps 30 \
    --out $W --name ops_ag_t4
  python3 $REPO/docs/perf/scripts/ops_variants.py $W/ops_ag_t4.json
fi
if (( T >= 4 )); then
  step layer_t4 110 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b,l70b \
    --configs megatron,nocomm,signal-p2p,signal-p2p-sm16 --reps 40 --rounds 6 --out $W --name layer_t4
  grep -E "^\| " $W/layer_t4.md | cut -d'|' -f1-10 | head -10
fi
step ops_ag_t2 60 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops ag \
  --ag-seq 8192 --reps 30 --out $W --name ops_ag_t2
python3 $REPO/docs/perf/scripts/ops_variants.py $W/ops_ag_t2.json
