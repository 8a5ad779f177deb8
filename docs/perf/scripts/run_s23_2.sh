# Session 23's second call (4 GPUs; ~7.5 min). The first (run_s23_1.sh) measured the copy probe, and then every
# step with the SM pulls hung: the pull kernel's first launch (its module load, which may wait for the running
# kernels) came beside a persistent GEMM spinning on the pulls' flags. PeerPull now loads it at plan build. Here:
# - the SM pulls' GPU tests at t = 2 (bitwise against the same kernel after a full gather, a late peer, 200 graph
#   replays with a late peer);
# - the AllGather+GEMM under graphs at t = 4 and t = 2: ours (copy engines) against p2p/sm16, p2p/sm32, async-TP;
# - what the ReduceScatters' remote epilogue stores cost (probe_remote_epilogue.py, t = 2);
# - the layer at t = 4, signal-p2p against signal-p2p-sm16.
# Prediction from run_s23_1's probe (the SM pull alone moves what the copy engines move, 180-300 GB/s per rank):
# the SM pulls no faster at t = 4 (l8b.qkv ~0.31 ms as the copy engines' 0.310), slower where the GEMM loses 16 SMs.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=470
workdir s23_2
step sm_pull_tests_t2 120 env CUDA_VISIBLE_DEVICES=0,1 python3 -m pytest -m gpu -v -rA --tb=short \
  $REPO/tests/gpu/test_ag_gemm_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  -k "s8192 or odd or late_peer or every_op_replays" -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/sm_pull_tests_t2.out | grep -v "^\.\./" | cut -c1-300 | tail -8
step ops_ag_t4 70 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops ag --ag-seq 8192 --reps 30 \
  --out $W --name ops_ag_t4
python3 $REPO/docs/perf/scripts/ops_variants.py $W/ops_ag_t4.json
step remote_epilogue 100 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 \
  $REPO/docs/perf/scripts/probe_remote_epilogue.py
grep -E "us;|remote - local|Error" $W/remote_epilogue.out | cut -c1-600
step ops_ag_t2 60 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops ag \
  --ag-seq 8192 --reps 30 --out $W --name ops_ag_t2
python3 $REPO/docs/perf/scripts/ops_variants.py $W/ops_ag_t2.json
step layer_t4 100 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,signal-p2p,signal-p2p-sm16 --reps 40 --rounds 5 --out $W --name layer_t4
grep -E "^\| " $W/layer_t4.md | cut -d'|' -f1-10 | head -8
