# Session 35's last four-GPU call (~6 min): `COMMIT=<sha> bash docs/perf/scripts/run_s35_x4_4.sh` (carry [".whl"]).
# llama3-8b at TP 4 (32 layers, local graphs, the recipe's defaults: signal, in place, fc1's wgrad deferred), the
# AllGathers' pulls by rows (--overlap-tp-chunk-by rows, the default before this session) against the default (by
# peer at TP 4), in alternating order. Predicted from call 3's layer (-0.143 ms per layer and micro-batch): 32 x 8 x
# 0.143 = -37 ms per iteration of ~2480 (-1.5%).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-470}
workdir s35_x4_4
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
i=0
for run in rows peer rows peer; do
  i=$((i + 1))
  extra=(); [[ $run == rows ]] && extra=(--overlap-tp-chunk-by rows)
  train l8b32-t4-$run-$i 115 GRAPHS=local TP=4 NPROC=4 OVERLAP=signal GATHER_IN_PLACE=1 DEFER_WGRAD=1 \
    TRAIN_ITERS=11 GBS=8 LOG_INTERVAL=1 -- $REPO/recipes/llama3-8b.sh "${extra[@]}"
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t4_chunk_by.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
