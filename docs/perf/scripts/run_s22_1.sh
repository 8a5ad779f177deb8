# The next session's FIRST call (~9 min), written in session 21; runs on 2 or 4 GPUs (T = the GPUs here).
# - The copy engines' rates for an AllGather's rows at t = 2 (and t = T): pulls (GatherBuffer today) against pushes
#   (async-TP's direction), serial on one stream against one stream per peer, alone and beside a GEMM
#   (probe_ce_copies.py). Session 21 at t = 4: serial pulls <= 320 GB/s, 140-220 beside the GEMM; async-TP's
#   AllGather+GEMM 0.218 ms against ours 0.321 at l8b.qkv. Decides whether the p2p AllGather should push.
# - The layer at t = 2 after session 21's ring order (it changed the signaled ReduceScatter's store order at t = 2
#   too: rank 0 now stores region 1 first), with the per-op mix (mixed-p2p); session 20 on H100s: 8B signal-p2p 0.950,
#   70B decompose-p2p 0.967 of Megatron's.
# - Issue 22's fused-block GPU tests written in session 20: two 8B / 70B layers at s 8192 with every p2p sum left to
#   the norms' kernels, bit for bit the summed path (3 steps), and 200 steps with a late peer (both methods).
# - With 4 GPUs: why test_gemm_ar's tile_exact case differs from its sequential twin at t = 4 (the test now says
#   whether the sequential path equals itself).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s22_1
T=$(nvidia-smi -L | wc -l)
step ce_t2 60 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_ce_copies.py
grep -E "^t=|checked" $W/ce_t2.out
if (( T >= 4 )); then
  step ce_t4 80 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_ce_copies.py
  grep -E "^t=|checked" $W/ce_t4.out
  # the AllGather+GEMM at t = 4 with its pulls on 1, 2 and 3 copy streams (copy_lanes), next to async-TP
  step ops_ag_t4 75 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops ag --ag-seq 8192 --reps 30 \
    --out $W --name ops_ag_t4
  grep -E "^\| " $W/ops_ag_t4.md | cut -d'|' -f1-15
  python3 -c "import json,sys; [print(r['shape'], r['ours'], r.get('variants')) for r in json.load(open(sys.argv[1]))['rows']]" \
    $W/ops_ag_t4.json
  step gemm_ar_t4 60 python3 -m pytest -m gpu -x -rA --tb=line $REPO/tests/gpu/test_gemm_rs_gpu.py -k "test_gemm_ar" \
    -p no:cacheprovider
  grep -E "AssertionError|passed|failed" $W/gemm_ar_t4.out | cut -c1-400 | tail -3
fi
step fused_block_tests 150 env CUDA_VISIBLE_DEVICES=0,1 python3 -m pytest -m gpu -v -rA --tb=short \
  $REPO/tests/gpu/test_layers_gpu.py -k "fused_blocks" -p no:cacheprovider --durations=0
grep -E "PASSED|FAILED|ERROR|passed|failed|s call" $W/fused_block_tests.out | grep -v "^\.\./" | tail -12
step layer_t2 150 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs \
  --models l8b,l70b --configs megatron,nocomm,signal-p2p,decompose-p2p,mixed-p2p --reps 40 --rounds 8 --out $W \
  --name layer_t2
grep -E "^\| " $W/layer_t2.md | cut -d'|' -f1-10 | head -12
