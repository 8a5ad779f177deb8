# The next session's third call (2 GPUs; ~5 min), written in session 27: `COMMIT=<sha> bash docs/perf/scripts/run_s28_3.sh`
# (carry [".whl"]). Issue 21: the smoke step's eager third (optimizer, zeroing, data: 13-16 ms of ~45, s27's profile)
# is Megatron's and the same on both sides; megatron-core 0.19.2 can capture the optimizer step too
# (`--optimizer-cuda-graph`, OptimizerCudaGraphWrapper). Both sides with it, off / signal twice each, to see whether it
# runs beside full_iteration graphs and shortens the step for both (then the recipes' fastest graph mode includes it,
# and the overlap's 1.4 ms a larger share). Predicted: off ~38 ms (from 41.7), the ratio ~1.03x.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s28_3
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
for i in 1 2; do
  for mode in off signal; do
    train smoke-optg-$mode-$i 75 OVERLAP=$mode TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh --optimizer-cuda-graph
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | tee $W/smoke_optg.md
grep -h -E "Error|error:|Traceback|AssertionError|capture" $W/*/train.log | sort | uniq -c | head -12
