# Session 34, call 6 (2 GPUs, `nvidia-h200-x2`; ~4.5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s34_x2_6.sh`
# (carry [".whl"]). The smoke after auto took the SM pulls (call 5: auto / off 1.054x and 1.081x): (1) one step
# profiled off / auto under full_iteration graphs, rank 0 (trace_summary.py: compute, exposed communication and idle
# per step, kernels by time), auto's decisions from call 5's tune cache (docs/perf/s34/smoke_tune.json: nothing tuned
# here); (2) one more timing pair, auto first.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s34_x2_6
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
cp $REPO/docs/perf/s34/smoke_tune.json $W/smoke_tune.json
for mode in off auto; do
  limit=70; [[ $mode == off ]] && limit=95   # the first run compiles
  train smoke-$mode-prof $limit OVERLAP=$mode TUNE_CACHE=$W/smoke_tune.json TRAIN_ITERS=24 -- $REPO/recipes/smoke.sh \
    --profile --use-pytorch-profiler --profile-step-start 22 --profile-step-end 23 --profile-ranks 0
  trace=$W/smoke-$mode-prof/torch_profile/rank-0.json.gz
  python3 $REPO/docs/perf/scripts/trace_summary.py --steps 1 --top 30 $trace > $W/smoke_${mode}_step_summary.md 2>&1
  head -14 $W/smoke_${mode}_step_summary.md
  if (( $(stat -c %s $trace 2>/dev/null || echo 0) < 40000000 )); then mv $trace $W/smoke_${mode}_step.json.gz; fi
  rm -rf $W/smoke-$mode-prof/torch_profile
done
for mode in auto off; do
  train smoke-$mode-3 62 OVERLAP=$mode TUNE_CACHE=$W/smoke_tune.json TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*-3/train.log | sed "s#$W/##" | cut -c1-120 | tee $W/smoke.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
