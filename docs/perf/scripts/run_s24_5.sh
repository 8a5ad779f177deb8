# Session 24's fourth call (2 GPUs; ~6.5 min): the MoE layer's GPU tests that run_s24_4 did not reach (it cut the
# recomputed test at the step's limit after three passed), one step each, with -s: pytest's output capture had
# swallowed the workers' stacks (spawned workers inherit the captured descriptors, lost when the parent is killed).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=420
workdir s24_5
export CUDA_VISIBLE_DEVICES=0,1
for t in recomputed 200_back_to_back captured_with_static; do
  step layer_$t 130 python3 -m pytest -m gpu -v -rA -s --tb=short $REPO/tests/gpu/test_moe_layer_gpu.py -k $t \
    --durations=0 -p no:cacheprovider
  grep -E "PASSED|FAILED|ERROR|passed|failed|s call " $W/layer_$t.out | grep -v "^\.\./" | cut -c1-300 | tail -4
done
