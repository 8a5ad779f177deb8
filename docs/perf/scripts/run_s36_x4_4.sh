# Session 36's fourth four-GPU call (~6 min): `COMMIT=<sha> bash docs/perf/scripts/run_s36_x4_4.sh` (carry [".whl"]).
# llama3-8b at TP 4 (32 layers, local graphs, the recipe's defaults), the ReduceScatters' partials pushed by the copy
# engines (rs_transfer 'auto' -> 'copy' at TP 4) against --overlap-tp-rs-transfer epilogue, two pairs in alternating
# order. Predicted from call 2's layer (-0.067 ms per layer and micro-batch; 32 layers x 8 micro-batches): -17 ms of
# ~2473 ms per iteration (-0.7%).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s36_x4_4
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
i=0
for run in copy epilogue epilogue copy; do
  i=$((i + 1)); extra=(); [[ $run == epilogue ]] && extra=(--overlap-tp-rs-transfer epilogue)
  train l8b32-t4-$run-$i 115 GRAPHS=local TP=4 NPROC=4 OVERLAP=signal TRAIN_ITERS=11 GBS=8 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-8b.sh "${extra[@]}"
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t4.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
