# Session 24's sixth call (2 GPUs; ~2.5 min): the MoE combine's local-rows counter fix (every combine leaves its
# counters at 0; a count left over released another routing's exchange early). The layer's 200-step test that
# failed at its second routing (run_s24_6: relative error 0.221 on rank 1), and the captured layer (the reset
# under capture).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=190
workdir s24_7
export CUDA_VISIBLE_DEVICES=0,1
for t in 200_back_to_back captured_with_static; do
  step layer_$t 80 python3 -m pytest -m gpu -v -rA -s --tb=short $REPO/tests/gpu/test_moe_layer_gpu.py -k $t \
    --durations=0 -p no:cacheprovider
  grep -E -A12 "failed:$" $W/layer_$t.out | cut -c1-400 | head -20
  grep -E "PASSED|FAILED|passed|failed|s call " $W/layer_$t.out | grep -v "^\.\./" | cut -c1-300 | tail -3
done
