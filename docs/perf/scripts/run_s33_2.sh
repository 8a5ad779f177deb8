# Session 33's second call (4 GPUs, `nvidia-h200-x4`; ~8.5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s33_2.sh`
# (carry [".whl"]).
# 1. llama3-8b at TP 4 (32 layers) under Megatron's full_iteration graphs, never run for this model before: off
#    against signal gathering in place with fc1's wgrad deferred. Under whole-iteration graphs the MLP boundary's fused
#    sum (fc2's partials in the next layer's input norm) is linked, which per-layer graphs leave off. If both sides
#    run faster than under local graphs (call 1: off 2657.7, in place 2503.8, deferred 2480.1 ms), the recipe's
#    default graph mode changes (issue 21: the fastest mode for both sides).
# 2. The deferred-wgrad GPU test (signal and decompose) at t = 4 after those runs compiled the kernels: in call 1 it
#    ran first on a cold machine and hit its 95 s limit while compiling (session 32: 67 s warm).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s33_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
train l8b32-t4-fi-off-1 150 GRAPHS=full_iteration TP=4 NPROC=4 OVERLAP=off TRAIN_ITERS=12 GBS=8 -- \
  $REPO/recipes/llama3-8b.sh
train l8b32-t4-fi-dw-2 150 GRAPHS=full_iteration TP=4 NPROC=4 OVERLAP=signal GATHER_IN_PLACE=1 DEFER_WGRAD=1 \
  TRAIN_ITERS=12 GBS=8 -- $REPO/recipes/llama3-8b.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t4_fi.md
grep -h -E "elapsed time per iteration" $W/l8b32-*/train.log | cut -c1-140
grep -h -E "Error|error:|Traceback|out of memory" $W/*/train.log | sort | uniq -c | head -8
step dw_test_t4 200 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "deferred_fc1_wgrad"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/dw_test_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -4
# what is left: a second local pair (in place, deferred) for call 1's -23.7 ms
train l8b32-t4-inplace-3 110 GRAPHS=local TP=4 NPROC=4 OVERLAP=signal GATHER_IN_PLACE=1 TRAIN_ITERS=12 GBS=8 -- \
  $REPO/recipes/llama3-8b.sh
train l8b32-t4-dw-4 110 GRAPHS=local TP=4 NPROC=4 OVERLAP=signal GATHER_IN_PLACE=1 DEFER_WGRAD=1 TRAIN_ITERS=12 \
  GBS=8 -- $REPO/recipes/llama3-8b.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160
