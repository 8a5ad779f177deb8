# Session 38 (2 GPUs, `nvidia-h200-x2`; ~4 min): `COMMIT=<sha> bash docs/perf/scripts/run_s38_x2_b.sh` (carry
# [".whl"]). A second pair for run_s38_x2_1.sh's llama3-8b at TP 2, 32 layers, micro-batch 2 (off 4759.6, signal
# 4595.4 ms: 1.036x), in the other order (signal first), before MBS=2 becomes the recipe's default at TP 2.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s38_x2_b
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
for run in signal off; do
  train l8b32-t2-mbs2-$run-2 135 GRAPHS=local TP=2 NPROC=2 OVERLAP=$run MBS=2 TRAIN_ITERS=12 GBS=8 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-8b.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t2_mbs2_pair2.md
for d in $W/l8b32-*/; do echo "$(basename $d) $(grep -h 'after 2 iterations' $d/train.log | head -1 | grep -o 'max allocated.*')"; done
grep -h -E "Error|error:|Traceback|out of memory" $W/*/train.log | sort | uniq -c | head -8
