# Written in session 36 as run_s37_x4_2.sh; session 37 had no four-GPU call left for it (4 GPUs; ~6 min): `COMMIT=<sha>
# bash docs/perf/scripts/run_s38_x4_1.sh` (carry [".whl"]). llama3-8b at TP 4 (32 layers, local graphs), off / the
# recipe's defaults / off / the defaults on the same cards: the headline ratio with rs_transfer 'copy' the default
# (session 36's 1.076x / 1.074x ran before it; copy against epilogue -0.2% in another call). Session 37's layer: cuBLAS's
# regions with the copy engines tie the signaled copy (1.041 / 1.036 of the counterfactual), so no variant is added.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s38_x4_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
i=0
for run in off signal off signal; do   # ~85 s each on a warm machine
  i=$((i + 1))
  train l8b32-t4-$run-$i 115 GRAPHS=local TP=4 NPROC=4 OVERLAP=$run TRAIN_ITERS=11 GBS=8 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-8b.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t4.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
