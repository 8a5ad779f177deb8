# Session 34, call 5 (2 GPUs, `nvidia-h200-x2`; ~6.5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s34_x2_5.sh`
# (carry [".whl"]). (1) Gathering in place with the AllGather's pulls on SMs (the tuner's stand-in picks p2p/sm16 for
# linear_qkv), bit for bit the staged pair. (2) The smoke, off / auto in two interleaved rounds, a fresh tune cache:
# auto now measures the SM pulls for every AllGather (call 4: smoke.qkv 0.045 ms against 0.050 sequential and 0.063
# on the copy engines; fc1 0.063 against 0.076 / 0.069). Predicted: auto picks them for the smoke's AllGathers, the
# step ~0.5 ms shorter (16 AllGathers forward and 16 backward per step, 5-13 us each): inside the smoke's noise.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s34_x2_5
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step in_place_sm 150 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "auto_gathers_in_place"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/in_place_sm.out | cut -c1-200 | tail -3
i=0
for order in "off auto" "auto off"; do
  i=$((i + 1))
  for mode in $order; do
    limit=62; [[ $i == 1 ]] && limit=100   # round 1: compiles; the first auto run tunes (one cache)
    train smoke-$mode-$i $limit OVERLAP=$mode TUNE_CACHE=$W/smoke_tune.json TRAIN_ITERS=40 LOG_INTERVAL=2 -- \
      $REPO/recipes/smoke.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | cut -c1-120 | tee $W/smoke.md
grep -h "\[overlap_tp\] auto:" $W/smoke-auto-1/train.log | sort -u | cut -c1-200
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
