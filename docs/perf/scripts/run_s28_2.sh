# The next session's second call (2 GPUs; ~9.5 min), written in session 27: `COMMIT=<sha> bash docs/perf/scripts/run_s28_2.sh`
# (carry [".whl"]). Issue 21's llama3-8b at its 32 layers, TP 2, local graphs, off / signal / off / signal (s21, two H200s
# of a 4-GPU host: 1.024x; not re-measured since, while the dense path changed in s22-s26: the ring order, the tile rule,
# the MLP-boundary link at build). Predicted 1.02-1.03x. The cards that ran are in cards.txt.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s28_2
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
# 32 layers need the H200s' memory (the recipe's note: ~72 GB of optimizer state per GPU); on H100s the 8-layer model
# of s20 (`--num-layers 8`: off 750.1, signal 739.2 ms, 1.015x), compared only with itself
layers=(); name=l8b32
if grep -q H100 $W/cards.txt; then layers=(--num-layers 8); name=l8b8; fi
for i in 1 2; do
  for mode in off signal; do
    train $name-$mode-$i 140 GRAPHS=local OVERLAP=$mode TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-8b.sh "${layers[@]}"
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/$name-*/train.log | sed "s#$W/##" | tee $W/$name.md
grep -h -E "Error|error:|Traceback|OutOfMemory" $W/*/train.log | sort | uniq -c | head -8
