# Session 16, call 13 (ONE GPU): the training path end to end with this session's launch path, at TP 1 (one GPU: no
# communication, so what the overlap's path costs by itself): the smoke recipe, off and signal, under Megatron's
# full-iteration CUDA graphs (the recipe's default), each watched for a hang at exit; median ms/iteration after 10.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s16_thirteen
train smoke-tp1-off 120 TP=1 NPROC=1 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
train smoke-tp1-signal 120 TP=1 NPROC=1 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-tp1-*/train.log | tee $W/smoke_tp1.md
grep -E "Error|error:|Traceback" $W/smoke-tp1-*.out | head -5
