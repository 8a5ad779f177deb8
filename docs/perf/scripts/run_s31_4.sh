# Session 31's fourth call (4 GPUs, 4 x H200 with needs_h200; 299 s), sent as one inline command; this file is that
# command, laid out. run_s31_1.sh's 70B proxy runs, trimmed to the budget left (signal, off, signal; 12 iterations).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=470
export OVERLAP_TP_GIT_COMMIT=26a7e541a53ba5e67e647b4ac634beab582bff85
workdir s31_1
i=0
for mode in signal off signal; do
  i=$((i + 1))
  train l70b16-t4-$mode-$i 150 GRAPHS=local TP=4 NPROC=4 NUM_LAYERS=16 OVERLAP=$mode TRAIN_ITERS=12 GBS=4 -- \
    $REPO/recipes/llama3-70b-proxy.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l70b16-*/train.log | sed "s#$W/##" | tee $W/l70b16_t4.md
grep -h "gather-in-place\|\[recipe\]\|symmetric memory" $W/l70b16-t4-signal-1.out $W/l70b16-t4-signal-1/train.log | \
  head -4 | cut -c1-250
grep -h -E "Error|error:|OutOfMemory" $W/*/train.log | sort | uniq -c | head -5
