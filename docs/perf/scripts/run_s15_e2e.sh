# The next 2-GPU session's end-to-end call (nvidia-h200-x2), written in session 14 (one GPU only): issue 21's
# llama3-8b (8 layers) and llama3-70b-proxy (8 layers) with the overlap off and on, the same graph mode (local),
# on today's defaults: the layer benchmark measured 8B 0.937x and 70B 0.985x of Megatron's layer in session 13, the
# last end-to-end 8B run (session 11, before the fused MLP boundary) 0.997x. Median ms/iteration after 8.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s15_e2e
train l8b8-off 110 GRAPHS=local OVERLAP=off TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh --num-layers 8
train l8b8-signal 110 GRAPHS=local OVERLAP=signal TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh --num-layers 8
train l70b8-off 120 GRAPHS=local OVERLAP=off TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
train l70b8-signal 120 GRAPHS=local OVERLAP=signal TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b8-*/train.log | tee $W/l8b8_summary.md
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8-*/train.log | tee $W/l70b8_summary.md
