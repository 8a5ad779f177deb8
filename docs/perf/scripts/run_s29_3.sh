# The next session's third call (2 GPUs; ~8.5 min), written in session 28: `COMMIT=<sha> bash docs/perf/scripts/run_s29_3.sh`
# (carry [".whl"]). Issue 21: the smoke recipe under its full_iteration graphs, off / signal / auto in three rounds, each
# round in a new order. Session 28's call 4 had auto ahead of signal in both of its rounds (37.3 vs 40.0, 43.3 vs
# 46.8 ms) while rounds moved by up to 25% together: a lead, from two samples. Since session 28, rank 0 prints auto's
# decision per op shape (`[overlap_tp] auto: ...`), so the log says which path each op ran. If auto is ahead in every
# round, the smoke recipe's default becomes auto (README's main job).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s29_3
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
i=0
for order in "off signal auto" "auto off signal" "signal auto off"; do
  i=$((i + 1))
  for mode in $order; do
    train smoke-$mode-$i 62 OVERLAP=$mode TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | tee $W/smoke.md
grep -h "\[overlap_tp\] auto:" $W/smoke-auto-1/train.log | sort | uniq | head -12
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
