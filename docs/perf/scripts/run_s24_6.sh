# Session 24's fifth call (2 GPUs; ~3 min): the MoE layer's 200-step test, which run_s24_5 left hung with one rank in
# destroy_process_group (it had left its loop: a failed check, its message unprinted) and the other waiting for
# the counts of its next step. tests/distributed.py now prints a failing rank's traceback first and skips the
# teardown that waits for peers.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=200
workdir s24_6
export CUDA_VISIBLE_DEVICES=0,1
step layer_200 150 python3 -m pytest -m gpu -v -rA -s --tb=short $REPO/tests/gpu/test_moe_layer_gpu.py \
  -k 200_back_to_back --durations=0 -p no:cacheprovider
grep -E -A12 "failed:$" $W/layer_200.out | cut -c1-400 | head -40
grep -E "PASSED|FAILED|passed|failed|s call " $W/layer_200.out | grep -v "^\.\./" | cut -c1-300 | tail -4
