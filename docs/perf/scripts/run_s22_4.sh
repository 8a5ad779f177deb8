# Session 22's fourth call (~7 min, the budget's rest; GPUs 0-1).
# - issue 25: the mixtral-proxy recipe on vs off, both eager (call 3: megatron-core 0.19.2's local graphs abort on
#   its own MoE layer, overlap off too), 4 layers, 20 steps: throughput and loss.
# - issue 24: call 3's resume under full_iteration graphs matched the reference from iteration 13 on to ~1e-4 only
#   (iteration 12, the capture iteration, logs the mean of 11 and 12: Megatron's logging); the same fault + resume
#   eagerly (GRAPHS=none, deterministic mode) says whether the resume itself is bitwise; then the SIGSTOP case
#   (STALL=1) that call 3's step limit cut.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-420}
workdir s22_4
export CUDA_VISIBLE_DEVICES=0,1
for mode in off signal; do
  train mixtral-$mode 110 OVERLAP=$mode NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1 -- $REPO/recipes/mixtral-proxy.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/mixtral-*/train.log | tee $W/mixtral.md
cd $REPO
step faults 200 env STALL=1 COMMIT=${COMMIT:-unknown} OUT=$W/faults WORK=/tmp/s22f SKIP_INSTALL=1 GRAPHS=none \
  FORMATS=torch_dist DETERMINISTIC=1 bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
tail -16 $W/faults/summary.md 2>/dev/null; cat $W/faults/*_stuck.txt 2>/dev/null | head -20
