# Session 34, call 1 (2 GPUs, `nvidia-h200-x2`; ~8 min): `COMMIT=<sha> bash docs/perf/scripts/run_s34_x2_1.sh`
# (carry [".whl"]). Only 2-GPU kinds were lent this session, so run_s34_1.sh / run_s34_2.sh (t = 4) wait; this is
# their t = 2 part. OverlapConfig.chunk_by='peer' (session 33, CPU-tested only) on GPUs for the first time:
# 1. probe_op_timeline.py on l8b.qkv at t = 2 (N 3072 per rank): one profiled replay of each variant and of async-TP,
#    each variant's output checked against 'off' first (the first GPU run of chunk_by 'peer');
# 2. its bit-for-bit GPU cases (test_ag_gemm_gpu.py s8192, odd, 200 back-to-back calls with bias) at t = 2;
# 3. `bench ops --graphs` AllGather+GEMM at t = 2 on the 8B / 70B shapes (s 8192) and the smoke's (s 4096), with
#    p2p/by-peer and cublas-p2p/by-peer beside async-TP (s28 smoke: ours 0.061 / 0.068 against async-TP 0.047 /
#    0.061 ms; cuBLAS-p2p by peer is async-TP's algorithm on our pulls: predicted within ~5% of it);
# 4. the graph replays of every op (200 each, with the by-peer cases).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s34_x2_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step ag_timeline 120 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_op_timeline.py --m 8192 --k 4096 --n 3072
grep -E "^## " $W/ag_timeline.out
step ag_tests 150 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_ag_gemm_gpu.py -k "s8192 or odd or back_to_back"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/ag_tests.out | grep -v "^\.\./" | cut -c1-200 | tail -4
step ops_ag 100 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops ag \
  --ag-shapes l8b.qkv,l8b.fc1,l70b.qkv,l70b.fc1 --ag-seq 8192 --reps 30 --out $W --name ops_ag_t2_bypeer
grep -E "^\| ag " $W/ops_ag_t2_bypeer.md | cut -c1-240
grep -E "variants=" $W/ops_ag.out | sed -E "s/ seq=.* variants=/ /" | cut -c1-400
step ops_ag_smoke 60 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops ag \
  --ag-shapes smoke.qkv,smoke.fc1 --ag-seq 4096 --reps 50 --out $W --name ops_ag_smoke_t2_bypeer
grep -E "^\| ag " $W/ops_ag_smoke_t2_bypeer.md | cut -c1-240
grep -E "variants=" $W/ops_ag_smoke.out | sed -E "s/ seq=.* variants=/ /" | cut -c1-400
step graphs 140 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/graphs.out | grep -v "^\.\./" | cut -c1-200 | tail -3
