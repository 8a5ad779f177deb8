# Written in session 37 for the next session (2 GPUs, `nvidia-h200-x2`; ~7 min): `COMMIT=<sha> bash
# docs/perf/scripts/run_s38_x2_1.sh` (carry [".whl"]). Session 37: at a micro-batch of 2 one 8B layer reached its
# no-communication counterfactual (t = 4: 1.007 against 1.036 at a micro-batch of 1), and llama3-8b with 8 layers at
# TP 2 ran 1.032x / 1.037x of off at a micro-batch of 2 (1.025x at 1, session 34). Whether the recipe's 32 layers fit
# and gain the same at a micro-batch of 2 (same global batch), off and signal at micro-batch 1 and 2 in one call:
# if both sides are faster at 2 and ours gains more, MBS=2 becomes the llama3-8b recipe's default at TP 2 (the peak
# memory is in each train.log).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s38_x2_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
for mbs in 2 1; do
  for run in off signal; do
    train l8b32-t2-mbs$mbs-$run 130 GRAPHS=local TP=2 NPROC=2 OVERLAP=$run MBS=$mbs TRAIN_ITERS=12 GBS=8 \
      LOG_INTERVAL=1 -- $REPO/recipes/llama3-8b.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t2_mbs.md
grep -h -E "max allocated|memory \(MB\)" $W/*/train.log | sort | uniq -c | head -8
grep -h -E "Error|error:|Traceback|out of memory" $W/*/train.log | sort | uniq -c | head -8
