# Next session, call 2 (nvidia-h200-x2), written at the end of session 13: the smoke recipe at 0.945x of overlap
# off in session 13 (1.030x in session 11), A/B of the fused norm kernels: off, signal, and signal with
# --no-overlap-tp-fused-norms (Megatron's TransformerLayer around our linears), full-iteration graphs, twice
# in turn (the machine drifts), each watched for a hang at exit.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s14_b
for round in 1 2; do
  train smoke-off-$round 75 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=60 -- $REPO/recipes/smoke.sh
  train smoke-signal-$round 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=60 -- $REPO/recipes/smoke.sh
  train smoke-unfused-$round 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=60 -- $REPO/recipes/smoke.sh \
    --no-overlap-tp-fused-norms
done
python3 $REPO/docs/perf/scripts/summarize_runs.py $W/smoke-*/train.log | tee $W/smoke_ab.md
