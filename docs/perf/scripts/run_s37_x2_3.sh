# Session 37 (2 GPUs, `nvidia-h200-x2`; ~3.5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s37_x2_3.sh` (carry
# [".whl"]). A second pair for run_s37_x2_2.sh's llama3-8b at TP 2 (8 layers), micro-batch 2 (GBS 8): off 1399.1 against
# signal 1356.0 ms per iteration (1.032x; the signal run cut at its time limit after 7 measured iterations). This pair in
# the other order, with more time.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-230}
workdir s37_x2_3
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
i=0
for run in signal off; do
  i=$((i + 1))
  train l8b8-t2-mbs2-$run-$i 100 GRAPHS=local TP=2 NPROC=2 OVERLAP=$run MBS=2 TRAIN_ITERS=13 GBS=8 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-8b.sh --num-layers 8
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b8-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b8_t2_mbs2.md
