# The next session's second call (2 GPUs; ~9 min), written in session 31: `COMMIT=<sha> bash
# docs/perf/scripts/run_s32_2.sh` (carry [".whl"]).
# 1. The GPU tests rewritten in session 31: auto + gathering in place with the tuner's answers fixed (qkv on p2p, fc1 on
#    NCCL: both branches), and the in-place check at the 70B layer's shapes (signal and decompose).
# 2. The smoke, off / auto / auto gathering in place, two rounds in alternating order (auto in place ran once in
#    session 31, not against off). Predicted: in place within the smoke's noise of auto (only fc1's AllGather is on
#    p2p at the smoke's shapes: 4 x one [4096, 1024] staging copy fewer forward, ~4 x 10 us, and the backward's fc1
#    re-gathers, 0.1-0.2 ms of a ~40 ms step).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s32_2
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step in_place_tests 200 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "auto_gathers_in_place or 70b_layer_shape"
grep -E "PASSED|FAILED|passed|failed" $W/in_place_tests.out | grep -v "^\.\./" | cut -c1-200 | tail -5
i=0
for order in "off auto auto-inplace" "auto-inplace auto off"; do
  i=$((i + 1))
  for run in $order; do
    limit=62; [[ $i == 1 && $run != off ]] && limit=95   # round 1: compiles; the first auto run tunes (one cache)
    extra=(); [[ $run == auto-inplace ]] && extra=(--overlap-tp-gather-in-place)
    mode=${run%-inplace}
    train smoke-$run-$i $limit OVERLAP=$mode TUNE_CACHE=$W/smoke_tune.json TRAIN_ITERS=40 LOG_INTERVAL=2 -- \
      $REPO/recipes/smoke.sh "${extra[@]}"
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | tee $W/smoke.md
grep -h "\[overlap_tp\] auto: ag" $W/smoke-auto-inplace-1/train.log | sort -u | cut -c1-200
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
