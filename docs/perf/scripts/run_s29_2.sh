# The next session's second call (2 GPUs; ~8.5 min), written in session 28: `COMMIT=<sha> bash docs/perf/scripts/run_s29_2.sh`
# (carry [".whl"]); only after run_s29_1.sh's GPU tests passed. Issue 21's llama3-8b at its 32 layers (local graphs
# both sides): signal with and without `--overlap-tp-gather-in-place`, interleaved, and off once for the ratio
# (session 28: off 2435.6, signal 2377.7 ms, 1.024x). Predicted: in place ~12 ms per step less (session 22's 4.3 ms of
# stage copies per 8-layer step, 3-4 ms gained), ~1.03x of off. On H100s the 8-layer model (memory).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s29_2
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
layers=(); name=l8b32
if grep -q H100 $W/cards.txt; then layers=(--num-layers 8); name=l8b8; fi
train $name-signal-1 130 GRAPHS=local OVERLAP=signal TRAIN_ITERS=16 GBS=4 -- $REPO/recipes/llama3-8b.sh "${layers[@]}"
train $name-inplace-1 130 GRAPHS=local OVERLAP=signal TRAIN_ITERS=16 GBS=4 -- $REPO/recipes/llama3-8b.sh "${layers[@]}" \
  --overlap-tp-gather-in-place
train $name-off-1 130 GRAPHS=local OVERLAP=off TRAIN_ITERS=16 GBS=4 -- $REPO/recipes/llama3-8b.sh "${layers[@]}"
train $name-inplace-2 130 GRAPHS=local OVERLAP=signal TRAIN_ITERS=16 GBS=4 -- $REPO/recipes/llama3-8b.sh "${layers[@]}" \
  --overlap-tp-gather-in-place
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 6 $W/$name-*/train.log | sed "s#$W/##" | tee $W/$name.md
grep -h -E "Error|error:|Traceback|OutOfMemory|gather-in-place" $W/*/train.log | sort | uniq -c | head -8
