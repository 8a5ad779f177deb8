# Session 38 (4 GPUs, `nvidia-h200-x4`; ~7 min): `COMMIT=<sha> bash docs/perf/scripts/run_s38_x4_1.sh` (carry
# [".whl"]). llama3-8b at TP 4 (32 layers, local graphs, the recipe's defaults: in place, deferred wgrad, the copy
# engines' ReduceScatter pushes), off / signal at micro-batch 2 and 1 (same global batch 8). At TP 2 this session
# (run_s38_x2_1.sh) a micro-batch of 2 ran off 4759.6 / signal 4595.4 ms (1.036x) against 4794.1 / 4670.9 (1.026x)
# at 1; one 8B layer at t = 4 sat at 1.007 of its counterfactual at 2 against 1.036 at 1 (session 37). Whether the
# recipe's default becomes MBS=2 at TP 4 as well.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s38_x4_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
for mbs in 2 1; do
  for run in off signal; do   # ~85-100 s each on a warm machine
    train l8b32-t4-mbs$mbs-$run 125 GRAPHS=local TP=4 NPROC=4 OVERLAP=$run MBS=$mbs TRAIN_ITERS=11 GBS=8 \
      LOG_INTERVAL=1 -- $REPO/recipes/llama3-8b.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t4_mbs.md
for d in $W/l8b32-*/; do echo "$(basename $d) $(grep -h 'after 2 iterations' $d/train.log | head -1 | grep -o 'max allocated.*')"; done
grep -h -E "Error|error:|Traceback|out of memory" $W/*/train.log | sort | uniq -c | head -8
