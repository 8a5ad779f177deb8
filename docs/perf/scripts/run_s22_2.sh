# Session 22's second call (~8.5 min; 2 of the GPUs: GPUs 0-1 of a 4-GPU machine are an NV18 pair as on the 2-GPU one).
# Call 1 put our layer at t = 2 at Megatron's no-communication counterfactual (8B signal-p2p 0.935 of Megatron's,
# nocomm 0.943), yet llama3-8b end to end gains 2.4% (session 21, 32 layers) where the layer's gain predicts ~3.3%.
# Where the training step's time goes: one profiled iteration of llama3-8b (8 layers, local graphs, rank 0) with
# the overlap off and on (Megatron's --profile --use-pytorch-profiler), summarised per kernel class and kernel, so
# the two read side by side; the logged intervals before the profiled iteration stay clean. Then issue 22's fused
# block end to end: signal with --no-overlap-tp-fused-norms (every reduce-scatter summed, Megatron's bda + norm), and
# the fused-block late-peer test (decompose) that call 1's step limit cut.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s22_2
export CUDA_VISIBLE_DEVICES=0,1
for mode in off signal; do
  train l8b8-$mode-prof 110 GRAPHS=local OVERLAP=$mode TRAIN_ITERS=24 GBS=4 -- $REPO/recipes/llama3-8b.sh \
    --num-layers 8 --profile --use-pytorch-profiler --profile-step-start 22 --profile-step-end 23 --profile-ranks 0
  # megatron-core 0.19.2 (training.py) exports the profiled steps to <tensorboard dir>/../torch_profile/rank-<r>.json.gz
  trace=$W/l8b8-$mode-prof/torch_profile/rank-0.json.gz
  ls -la $trace
  python3 $REPO/docs/perf/scripts/trace_summary.py --steps 1 --top 30 $trace > $W/l8b8_${mode}_step_summary.md 2>&1
  head -12 $W/l8b8_${mode}_step_summary.md
  if (( $(stat -c %s $trace 2>/dev/null || echo 0) < 40000000 )); then mv $trace $W/l8b8_${mode}_step.json.gz; fi
  rm -rf $W/l8b8-$mode-prof/torch_profile
done
train l8b8-signal-unfused 110 GRAPHS=local OVERLAP=signal TRAIN_ITERS=24 GBS=4 -- $REPO/recipes/llama3-8b.sh \
  --num-layers 8 --no-overlap-tp-fused-norms
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b8-*/train.log | tee $W/l8b8.md
step fused_late_decompose 170 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_layers_gpu.py \
  -k "fused_blocks_200_steps_with_a_late_peer and decompose" -p no:cacheprovider --durations=0
grep -E "PASSED|FAILED|ERROR|passed|failed|s call" $W/fused_late_decompose.out | grep -v "^\.\./" | tail -6
