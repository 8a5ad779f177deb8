# Written in session 36 for the next session (4 GPUs, `nvidia-h200-x4` or `nvidia-h100-x4`; ~9 min): `COMMIT=<sha>
# bash docs/perf/scripts/run_s37_x4_1.sh` (carry [".whl"]). After rs_transfer 'copy' (the default for method signal at
# t > 2 since session 36: one 8B layer at t = 4 1.045 -> 1.034 of the counterfactual on four H200s; issue 22 asks
# <= 1.02). Session 36's layer trace put the rest at the signaled GEMM beside the copy engines (5-9% slower than cuBLAS:
# fc2 335 against 306 us, fc1's dgrad 654 against 607) and ~14 us between pushes (a wait kernel after each push).
# Method 'decompose' with rs_transfer 'copy' (built in session 36, not yet run on GPUs): cuBLAS per region into the
# staging matrix, each region pushed behind a stream dependency (no wait kernel). Predicted for the 8B layer at t = 4:
# ~80-100 us less than signal's copy (fc2 ~320, fc1's dgrad ~625 us), i.e. ~1.02 of the counterfactual.
# 1. its GPU tests at t = 4 (test_gemm_rs_gpu.py s 8192 / odd / async_op; every op's graph replays);
# 2. `bench ops --graphs` on the four GEMM+RS shapes (cublas-p2p/copy beside p2p/copy and p2p/epilogue);
# 3. the GEMM+RS timeline at l8b.proj and l8b.fc2: epilogue / copy / copy-g2 / cublas-copy;
# 4. one 8B and one 70B layer: signal-p2p-inplace-dw (copy) against mixed-p2p-rscopy-inplace-dw, four rounds.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s37_x4_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step rs_tests_t4 150 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_gemm_rs_gpu.py -k "s8192 or odd or async"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/rs_tests_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -6
step graphs_t4 90 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_graphs_gpu.py -k every_op
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/graphs_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -3
step ops_rs_t4 60 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops rs --seq 8192 --reps 30 \
  --out $W --name ops_rs_t4
grep -E "^\| rs " $W/ops_rs_t4.md | cut -c1-240
for shape in 8192,1024,4096 8192,3584,4096; do   # l8b.proj, l8b.fc2 at t = 4 (M, K_local, N)
  step rs_timeline_${shape//,/_} 60 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_op_timeline.py --op rs \
    --shape $shape --variants epilogue,copy,copy-g2,cublas-copy
  grep -E "^## " $W/rs_timeline_${shape//,/_}.out
done
step layer_t4 150 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b,l70b --seq 8192 \
  --configs megatron,nocomm,signal-p2p-inplace-dw,mixed-p2p-rscopy-inplace-dw --reps 16 --rounds 4 --out $W \
  --name layer_t4_cublas_copy
grep -E "^\| l(8|70)b " $W/layer_t4_cublas_copy.md | cut -c1-200
