# Session 16, call 15 (ONE GPU): call 13 again after its finding: at TP 1 the recipes failed without Apex (Megatron's
# local spec runs there, and its torch norm refuses Megatron's default persistent LayerNorm, an Apex kernel); the
# recipes now pass --no-persist-layer-norm and --no-masked-softmax-fusion without Apex (call 14 then stopped at the
# softmax: scaled_masked_softmax_cuda not found). The smoke, off and signal, full-iteration graphs, TP 1.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s16_fifteen
train smoke-tp1-off 120 TP=1 NPROC=1 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
train smoke-tp1-signal 120 TP=1 NPROC=1 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-tp1-*/train.log | tee $W/smoke_tp1.md
grep -E "Error|error:|Traceback" $W/smoke-tp1-*.out | head -5
