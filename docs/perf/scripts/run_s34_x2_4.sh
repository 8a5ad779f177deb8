# Session 34, call 4 (2 GPUs, `nvidia-h200-x2`; ~7 min): `COMMIT=<sha> bash docs/perf/scripts/run_s34_x2_4.sh`
# (carry [".whl"]). The SM pulls rebuilt as one kernel per call with the handshakes inside (kernels/peer_copy.py
# SignaledPull: READY exchange, each chunk's flag and PULLED as the kernel's stores and spins; call 3 measured a
# stream memory operation hop at ~6 us inside a graph, a kernel's at ~1-2). First: its GPU tests (the kernel on one
# GPU; ag_gemm's p2p/sm16 and p2p/g8/sm8 through the real mappings; 200 graph replays; a peer that never replays
# ends the waiting rank through the kernel's own deadline). Then the smoke's AllGather+GEMMs: timelines and `bench
# ops --graphs` (p2p/sm16, p2p/sm32 beside the copy engines and async-TP), and the 8B / 70B shapes.
# Predicted at smoke.qkv (M 4096, K 1024, N 768): ~30 us (stage 2 + READY 1.5 + 4 MB pulled ~15 + tail 5-9) against
# 47-57 for the copy engines' paths, 49-55 sequential.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s34_x2_4
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step kernel_test 90 python3 -m pytest -m gpu -q -rA -s --tb=short -p no:cacheprovider $REPO/tests/gpu/test_peer_copy_gpu.py
grep -E "passed|failed" $W/kernel_test.out | tail -2
step ag_tests 150 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_ag_gemm_gpu.py -k "s8192 or odd or back_to_back or late_peer"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/ag_tests.out | cut -c1-200 | tail -6
P=$REPO/docs/perf/scripts/probe_op_timeline.py
step tl_ag_qkv 80 torchrun --nproc-per-node 2 $P --op ag --shape 4096,1024,768 --variants ours,sm16,sm32,sm32-narrow,narrow-g1
step tl_ag_fc1 70 torchrun --nproc-per-node 2 $P --op ag --shape 4096,1024,2816 --variants ours,sm16,sm32,sm32-narrow
for f in tl_ag_qkv tl_ag_fc1; do echo "=== $f"; grep -E "^## |^  " $W/$f.out | grep -v "^  _warn\|^  symm" | head -60; done
step ops_ag_smoke 60 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops ag \
  --ag-shapes smoke.qkv,smoke.fc1 --ag-seq 4096 --reps 50 --out $W --name ops_ag_smoke_t2_sm
grep -E "^\| ag " $W/ops_ag_smoke_t2_sm.md | cut -c1-240
grep -E "variants=" $W/ops_ag_smoke.out | sed -E "s/ seq=.* variants=/ /" | cut -c1-400
step graphs 200 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays or never_replays or split"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/graphs.out | cut -c1-200 | tail -6
step ops_ag 100 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops ag \
  --ag-shapes l8b.qkv,l8b.fc1,l70b.qkv --ag-seq 8192 --reps 30 --out $W --name ops_ag_t2_sm
grep -E "^\| ag " $W/ops_ag_t2_sm.md | cut -c1-240
grep -E "variants=" $W/ops_ag.out | sed -E "s/ seq=.* variants=/ /" | cut -c1-400
