# Next session, call 2 (nvidia-h200-x2), written at the end of session 13: the smoke recipe at 0.945x of overlap
# off in session 13 (1.030x in session 11), A/B of the fused norm kernels: off, signal, and signal with
# --no-overlap-tp-fused-norms (Megatron's TransformerLayer around our linears), full-iteration graphs, twice
# in turn (the machine drifts), each watched for a hang at exit. First the GPU tests that session 13's review
# reshaped after its device time (one fwd/bwd helper in the bitwise layer tests, one watchdog-exit helper in the
# graph tests, the pre-MLP norm's handover through OverlapRMSNorm.hand_over).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s14_b
step gpu_tests 160 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_layers_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  -k "p2p_sum or mlp_boundary or never" -p no:cacheprovider
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.out | tail -8
for round in 1 2; do
  train smoke-off-$round 75 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=50 -- $REPO/recipes/smoke.sh
  train smoke-signal-$round 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=50 -- $REPO/recipes/smoke.sh
  train smoke-unfused-$round 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=50 -- $REPO/recipes/smoke.sh \
    --no-overlap-tp-fused-norms
done
python3 $REPO/docs/perf/scripts/summarize_runs.py $W/smoke-*/train.log | tee $W/smoke_ab.md
