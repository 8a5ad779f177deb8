# The next 2-GPU session's FIRST call (~9.5 min), written in session 20. Needs H200s (pass needs_h200: llama3-8b at
# 32 layers holds ~100 GB per GPU at TP 2 without data parallelism; session 20's H100 pair ran out of memory on the
# 70B proxy at 8 layers already). If only H100 pairs come: add `--num-layers 16` to the three llama3-8b runs (~half the
# memory) and say so in the record.
# Issue 21's llama3-8b target (>= 1.03x) at the recipe's own depth: 32 layers, local graphs, off / signal / decompose
# (cuBLAS over p2p: `--overlap-tp decompose` with the transport's auto since session 20). Predicted from session 20
# (docs/perf/s20/README.md): at 8 layers the layers were about half of the iteration (the 128k-vocabulary output layer,
# its cross entropy and the optimizer the rest) and the run realised half of the layer benchmark's gain (1.015x of a
# ~1.029x no-communication ceiling); at 32 layers the layers' share is ~4x larger, so the ceiling is ~1.04-1.05x and
# 1.02-1.04x is expected (session 10, older code: off 1295.7 ms, signal 1.002x).
# Then issue 22's fused-block GPU tests written in session 20: two 8B / 70B layers at s 8192 with every p2p sum left
# to the norms' kernels, bit for bit the summed path (3 steps), and 200 steps with a late peer (both methods).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s21_x2_1
train l8b32-off 150 GRAPHS=local OVERLAP=off TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-8b.sh
train l8b32-signal 150 GRAPHS=local OVERLAP=signal TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-8b.sh
train l8b32-decompose 150 GRAPHS=local OVERLAP=decompose TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-8b.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b32-*/train.log | tee $W/l8b32.md
grep -h -E "Error|error:|Traceback|OutOfMemory" $W/*/train.log | sort | uniq -c | head -8
step fused_block_tests 130 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_layers_gpu.py \
  -k "fused_blocks" -p no:cacheprovider --durations=0
grep -E "PASSED|FAILED|ERROR|passed|failed|s call" $W/fused_block_tests.out | grep -v "^\.\./" | tail -12
