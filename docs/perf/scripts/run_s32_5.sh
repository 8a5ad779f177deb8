# Session 32's fifth call (2 of the 4 GPUs, right after run_s32_4.sh; ~4.5 min): `COMMIT=<sha> bash
# docs/perf/scripts/run_s32_5.sh` (carry [".whl"]). Two more interleaved smoke pairs, auto against off under
# full_iteration graphs, for issue 21's 1.10x target (s28-s32: nine pairs, median ~1.06x); auto's decisions from
# run_s32_2.sh's tune cache (docs/perf/s32/smoke_tune.json, copied: the runs tune nothing).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-290}
workdir s32_5
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
cp $REPO/docs/perf/s32/smoke_tune.json $W/smoke_tune.json
i=0
for order in "auto off" "off auto"; do
  i=$((i + 1))
  for mode in $order; do
    train smoke-$mode-$i 66 OVERLAP=$mode TUNE_CACHE=$W/smoke_tune.json TRAIN_ITERS=40 LOG_INTERVAL=2 -- \
      $REPO/recipes/smoke.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | cut -c1-120 | tee $W/smoke.md
grep -h "\[overlap_tp\] auto:" $W/smoke-auto-1/train.log | sort -u | cut -c1-160
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
