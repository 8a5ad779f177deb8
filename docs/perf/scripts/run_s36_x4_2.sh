# Session 36's second four-GPU call (~9 min): `COMMIT=<sha> bash docs/perf/scripts/run_s36_x4_2.sh` (carry [".whl"]).
# OverlapConfig.rs_transfer 'copy' (new, the default where t > 2): the signaled GEMM+ReduceScatter stores the peers'
# partials locally and the copy engines push each owner's region behind the GEMM's counters. Call 1's profile of one
# 8B layer at t = 4 (four H200s) put ~230 us per layer at the four ReduceScatter edges (the epilogue's remote stores
# lengthen proj 97 -> 177, fc2 306 -> 346, fc1's dgrad 607 -> 663, qkv's dgrad 137 -> 196 us); predicted with the
# copy engines: ~150 us less per layer (fc2, fc1's and qkv's dgrads hidden behind their GEMM or the wgrad after it;
# proj's 48 MB still outlast its 97 us GEMM).
# 1. its GPU tests at t = 4: test_gemm_rs_gpu.py (s 8192, odd shapes, 200 back-to-back calls, async_op), every op's
#    200 graph replays (test_graphs_gpu.py, with the copy configs);
# 2. `bench ops --graphs` on the four GEMM+RS shapes: ours (copy), p2p/epilogue, the baselines;
# 3. one 8B and one 70B layer under graphs, copy (the default) against epilogue, profiled.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s36_x4_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step rs_tests_t4 200 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_gemm_rs_gpu.py -k "s8192 or odd or back_to_back or async"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/rs_tests_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -8
step graphs_t4 130 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_graphs_gpu.py -k every_op
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/graphs_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -4
step ops_rs_t4 90 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops rs --seq 8192 --reps 30 \
  --out $W --name ops_rs_t4
grep -E "^\| rs " $W/ops_rs_t4.md | cut -c1-240
step layer_t4 150 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b,l70b --seq 8192 \
  --configs megatron,nocomm,signal-p2p-inplace-dw,signal-p2p-rsepilogue-inplace-dw --reps 16 --rounds 3 --out $W \
  --name layer_t4_rs --profile $W/prof
grep -E "^\| l(8|70)b " $W/layer_t4_rs.md | cut -c1-200
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 $W/prof/l8b_*_graph_rank0.json.gz > $W/layer_t4_rs_trace.txt 2>&1
grep -E "^## |per step" $W/layer_t4_rs_trace.txt
