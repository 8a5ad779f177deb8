# Session 28's fourth call (2 GPUs; ~7 min): `COMMIT=<sha> bash docs/perf/scripts/run_s28_4.sh` (carry [".whl"]).
# Issue 21: the smoke recipe under its full_iteration graphs with --overlap-tp auto beside off, signal and decompose,
# interleaved in two rounds. Call 1 of this session timed the smoke's TP ops under graphs: signal loses to cuBLAS +
# NCCL on the forward qkv AllGather (0.80x) and wins on the other three (1.09-1.26x); `auto` measures each op's
# candidates at plan build (graph replays under full_iteration) and may keep the sequential path where it is faster.
# Predicted: auto within 1% of signal (the qkv AllGathers are ~0.2 ms of a ~40 ms step).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=560
workdir s28_4
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
for mode in off signal auto decompose; do
  train smoke-$mode-1 70 OVERLAP=$mode TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
done
for mode in auto signal off; do
  train smoke-$mode-2 70 OVERLAP=$mode TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | tee $W/smoke.md
grep -h "overlap_tp\].*auto\|tune\|chose" $W/smoke-auto-1/train.log | head -12
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
