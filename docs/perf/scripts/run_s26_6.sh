# Session 26's fourth call (2 GPUs; ~6 min). 1. Issue 25's loss parity with the MoE overlap on too: mixtral-proxy
# under --deterministic-mode, overlap signal (dense and expert ops), against run_s26_5's off runs (which were
# bitwise equal to each other and to the dense overlap alone for 20 iterations). 2. Issue 24's SIGKILL + resume under
# the recipe's full-iteration CUDA graphs, torch_dist, deterministic (run_s26_1 ran it eager).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=570
workdir s26_6
export CUDA_VISIBLE_DEVICES=0,1
M="NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1"
D="--deterministic-mode --no-overlap-tp-stats"
train mixtral-det-signal 110 OVERLAP=signal $M -- $REPO/recipes/mixtral-proxy.sh $D
train mixtral-det-off 110 OVERLAP=off $M -- $REPO/recipes/mixtral-proxy.sh $D
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 6 $W/mixtral-det-*/train.log | sed "s#$W/##" | tee $W/mixtral_det.md
cd $REPO
step faults_graphs 300 env DETERMINISTIC=1 FORMATS=torch_dist FAULT_OVERLAP=signal COMMIT=${COMMIT:-unknown} \
  OUT=$W/faults_graphs WORK=/tmp/s26g SKIP_INSTALL=1 bash docs/perf/scripts/run_s10_faults.sh
grep -E "^\| |^- " $W/faults_graphs/summary.md 2>/dev/null | cut -c1-300 | sort -u
rm -rf /tmp/s26g
cd /tmp
