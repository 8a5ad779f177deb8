# Session 41, call 5 (2 GPUs, `nvidia-h200-x2`; ~5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s41_x2_5.sh`
# (carry [".whl"]). Issue 20 end to end, eager: the smoke recipe without CUDA graphs (GRAPHS=none), 40 iterations,
# off / signal / signal with the replays off (OVERLAP_TP_EAGER_GRAPHS=0). Predicted: signal with replays faster than
# without by what the host saves per call where the step is host-bound (session 10: eager signal 207.9 ms); which of
# the smoke's calls replay: the gemm_rs whose sum is not deferred into a norm, the AllGathers (in place ones too).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-400}
workdir s41_x2_5
train smoke-off 110 OVERLAP=off GRAPHS=none TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
train smoke-signal 90 OVERLAP=signal GRAPHS=none TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
train smoke-signal-noreplay 90 OVERLAP=signal GRAPHS=none OVERLAP_TP_EAGER_GRAPHS=0 TRAIN_ITERS=40 LOG_INTERVAL=2 \
  -- $REPO/recipes/smoke.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | cut -c1-120 | tee $W/smoke_eager.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
grep -h "lm loss" $W/smoke-*/train.log | tail -3 | cut -c1-200
