# Session 31's second call (4 GPUs, 4 x H200; 392 s), sent as one inline command; this file is that command, laid out.
# run_s31_2.sh's llama3-8b runs had been cut: 14 iterations at TP 4 (2.5 s each after 11-26 s of compile and capture
# in iteration 1) do not fit 90 s. Here 12 iterations under 135 s, gathering in place against off, interleaved.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
export OVERLAP_TP_GIT_COMMIT=26a7e541a53ba5e67e647b4ac634beab582bff85
workdir s31_2b
i=0
for run in inplace off inplace off; do
  i=$((i + 1))
  mode=signal; [[ $run == off ]] && mode=off
  train l8b32-t4-$run-$i 135 GRAPHS=local TP=4 NPROC=4 OVERLAP=$mode GATHER_IN_PLACE=1 TRAIN_ITERS=12 GBS=8 -- \
    $REPO/recipes/llama3-8b.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l8b32-*/train.log | sed "s#$W/##" | tee $W/l8b32_t4.md
grep -h "symmetric memory" $W/l8b32-t4-inplace-1/train.log | head -1 | cut -c1-250
