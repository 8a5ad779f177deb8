# Session 33's third call (4 GPUs, `nvidia-h200-x4`; ~8.5 min, the session's last device time): `COMMIT=<sha> bash
# docs/perf/scripts/run_s33_3.sh` (carry [".whl"]). Where else --overlap-tp-defer-wgrad pays, before it becomes the
# recipes' default wherever they gather in place. Calls 1-2: llama3-8b at TP 4 -23.7 / -21.4 ms per iteration.
# 1. llama3-8b at TP 2 (32 layers, two of the GPUs; the recipe's defaults: signal in place): without / with.
#    Predicted: smaller than at t = 4 (proj's pulls are half the bytes against a GEMM twice as long): 0-10 ms.
# 2. The 70B proxy at TP 4 (16 layers; its defaults: signal in place): without / with. Its layer at t = 4 is already
#    within 1% of the counterfactual (s30): predicted a tie, or a loss if fc1's wgrad slows beside the pulls.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-545}
workdir s33_3
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
for run in inplace dw; do
  defer=0; [[ $run == dw ]] && defer=1
  CUDA_VISIBLE_DEVICES=0,1 train l8b32-t2-$run 125 GRAPHS=local TP=2 NPROC=2 OVERLAP=signal GATHER_IN_PLACE=1 \
    DEFER_WGRAD=$defer TRAIN_ITERS=12 GBS=4 -- $REPO/recipes/llama3-8b.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l8b32-t2-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t2_dw.md
for run in inplace dw; do
  defer=0; [[ $run == dw ]] && defer=1
  train l70b16-t4-$run 125 GRAPHS=local TP=4 NPROC=4 NUM_LAYERS=16 OVERLAP=signal GATHER_IN_PLACE=1 \
    DEFER_WGRAD=$defer TRAIN_ITERS=12 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l70b16-t4-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l70b16_t4_dw.md
grep -h -E "Error|error:|Traceback|out of memory" $W/*/train.log | sort | uniq -c | head -8
