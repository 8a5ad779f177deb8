# Session 29's fifth call (2 GPUs; ~4.5 min, the session's last device time): `COMMIT=<sha> bash
# docs/perf/scripts/run_s29_6.sh` (carry [".whl"]). The smoke recipe under its full_iteration graphs: gathering in
# place captured inside Megatron's whole-iteration graph (never run before), and one round of off / signal / auto
# (run_s29_3.sh's three rounds did not fit the session's device time) with auto's per-op decisions logged.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=330
workdir s29_6
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
train smoke-inplace 62 OVERLAP=signal TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh --overlap-tp-gather-in-place
for mode in off auto signal; do
  train smoke-$mode 62 OVERLAP=$mode TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | tee $W/smoke.md
grep -h "\[overlap_tp\] auto:" $W/smoke-auto/train.log | sort | uniq | head -12 | cut -c1-200
grep -h -E "Error|error:|Traceback|own gathered" $W/*/train.log | sort | uniq -c | head -8 | cut -c1-250
