# The next session's second call, written in session 33 (4 GPUs, `nvidia-h200-x4`; ~8 min): `COMMIT=<sha> bash
# docs/perf/scripts/run_s34_2.sh` (carry [".whl"]). OverlapConfig.chunk_by='peer' (session 33, CPU-tested only):
# 1. its GPU cases bit for bit: test_ag_gemm_gpu.py (every config incl. p2p/by-peer, p2p/by-peer/g3 and
#    cublas-p2p/by-peer, at s 8192 and the odd shapes) and the graph replays (200 per op, test_graphs_gpu.py), at t = 4,
#    with -s so that a stuck worker's stack reaches the output;
# 2. `bench ops --graphs` at t = 4 on the four AllGather shapes: ours (rows) against p2p/by-peer and
#    cublas-p2p/by-peer, with async-TP (session 33: l8b.qkv ours 0.310, async-TP 0.216 ms);
# 3. one 8B layer at t = 4 under graphs: signal-p2p-inplace-dw against signal-p2p-bypeer-inplace-dw (session 32:
#    0.897 of Megatron's for the first), 4 rounds.
# Predicted, if the copies set the per-chunk cost: l8b.qkv ~0.285 ms; the layer -0.05 to -0.1 ms.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-585}
workdir s34_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step ag_tests_t4 220 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_ag_gemm_gpu.py -k "s8192 or odd"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/ag_tests_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -4
step ops_ag_t4 90 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops ag --ag-seq 8192 --reps 30 \
  --out $W --name ops_ag_t4_bypeer
grep -E "^\| ag " $W/ops_ag_t4_bypeer.md | cut -c1-220
step layer_t4 110 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --configs megatron,nocomm,signal-p2p-inplace-dw,signal-p2p-bypeer-inplace-dw --reps 16 --rounds 4 --out $W \
  --name layer_t4_bypeer
grep -E "^\| l8b " $W/layer_t4_bypeer.md | cut -c1-200
step graphs_t4 140 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/graphs_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -3
