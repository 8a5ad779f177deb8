# Session 35's first four-GPU call (`nvidia-h100-x4` was the four-GPU kind lent; ~9 min): `COMMIT=<sha> bash
# docs/perf/scripts/run_s35_x4_1.sh` (carry [".whl"]). Session 33's two t = 4 scripts, which waited two sessions for
# four GPUs, split over two calls by time: run_s34_1.sh's AllGather timeline at l8b.qkv (why ours trails async-TP at
# t = 4: session 33 measured 0.310 against 0.216 ms), then run_s34_2.sh's first two steps (chunk_by 'peer' bit for bit
# at t = 4, `bench ops --graphs` on the four AllGather shapes with by-peer and the SM pulls). run_s35_x4_2.sh has the
# rest (the 8B layer, the graph replays).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s35_x4_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step ag_timeline 170 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_op_timeline.py --op ag --shape 8192,4096,1536 \
  --variants ours,g1,g2,sm16,sm32,narrow,narrow-763,by-peer,cublas-by-peer,lanes2
grep -E "^## " $W/ag_timeline.out
step ag_tests_t4 220 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_ag_gemm_gpu.py -k "s8192 or odd"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/ag_tests_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -4
step ops_ag_t4 100 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops ag --ag-seq 8192 --reps 30 \
  --out $W --name ops_ag_t4_bypeer
grep -E "^\| ag " $W/ops_ag_t4_bypeer.md | cut -c1-220
