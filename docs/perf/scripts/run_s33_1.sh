# The next session's first call (4 GPUs, `nvidia-h200-x4`; ~9.5 min), written in session 32:
# `COMMIT=<sha> bash docs/perf/scripts/run_s33_1.sh` (carry [".whl"]). A second in-place run belongs in the next call.
# --overlap-tp-defer-wgrad end to end: llama3-8b at TP 4, 32 layers, local graphs, the recipe's defaults (signal,
# gathering in place) with DEFER_WGRAD=1 against without and against off, interleaved. Session 32 measured one 8B
# layer at t = 4 under graphs 6.441 -> 6.291 ms with it (docs/perf/s32/README.md). Predicted: 32 layers x (fwd+bwd)
# x 8 micro-batches x -0.15 ms = ~-38 ms of ~2522 ms per iteration: in place 1.062x of off -> ~1.078x with it.
# 12 iterations under 110 s each (session 31: 93-100 s used).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s33_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
# the deferral's gradient now returns through linear_proj's Function (session 32, after its GPU test ran the earlier
# version): its GPU test first, signal at t = 4 (~70 s)
step dw_test_t4 95 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "deferred_fc1_wgrad and signal"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/dw_test_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -3
i=0
for run in dw inplace off dw; do   # 4 runs after the test: ~95 + 4 x 110 s
  i=$((i + 1))
  mode=signal; [[ $run == off ]] && mode=off
  defer=0; [[ $run == dw ]] && defer=1
  train l8b32-t4-$run-$i 110 GRAPHS=local TP=4 NPROC=4 OVERLAP=$mode GATHER_IN_PLACE=1 DEFER_WGRAD=$defer \
    TRAIN_ITERS=12 GBS=8 -- $REPO/recipes/llama3-8b.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t4_dw.md
grep -h "inside linear_proj's backward" $W/l8b32-t4-dw-1/train.log | head -1 | cut -c1-200
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
