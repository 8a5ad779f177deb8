# The next 2-GPU session's FIRST call (~9.5 min), written in session 20. Needs H200s (pass needs_h200: llama3-8b at
# 32 layers holds ~100 GB per GPU at TP 2 without data parallelism; session 20's H100 pair ran out of memory on the
# 70B proxy at 8 layers already).
# Issue 21's llama3-8b target (>= 1.03x) at the recipe's own depth: 32 layers, local graphs, off / signal / decompose
# (cuBLAS over p2p: `--overlap-tp decompose` with the transport's auto since session 20). Predicted from session 20
# (docs/perf/s20/README.md): the no-communication ceiling 1 + 0.667 ms x 128 layer steps / ~1930 ms = ~1.045x;
# 8 layers realised half of the layer benchmark's gain (1.015x of a 1.029x ceiling), so 1.02-1.04x here.
# Then the 70B proxy's missing row: signal at 8 layers (session 20: off 1964.5, decompose 1911.3 ms on an H200 pair).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s21_x2_1
train l8b32-off 150 GRAPHS=local OVERLAP=off TRAIN_ITERS=15 GBS=4 -- $REPO/recipes/llama3-8b.sh
train l8b32-signal 150 GRAPHS=local OVERLAP=signal TRAIN_ITERS=15 GBS=4 -- $REPO/recipes/llama3-8b.sh
train l8b32-decompose 150 GRAPHS=local OVERLAP=decompose TRAIN_ITERS=15 GBS=4 -- $REPO/recipes/llama3-8b.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b32-*/train.log | tee $W/l8b32.md
train l70b8-signal 115 GRAPHS=local OVERLAP=signal TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8-*/train.log | tee $W/l70b8.md
grep -h -E "Error|error:|Traceback|OutOfMemory" $W/*/train.log | sort | uniq -c | head -8
