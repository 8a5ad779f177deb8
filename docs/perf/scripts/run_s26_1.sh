# The next session's first call (2 GPUs; ~8-10 min), written in session 25 after 174e95d (the MLP boundary linked when
# the layers are built; before, a process's first microbatch ran it unfused, which made the resumed run's first
# update differ: docs/perf/s25/README.md). Issue 24:
# 1. SIGKILL + resume with the overlap on, eager, deterministic, both checkpoint formats, against the uninterrupted
#    run: expected now, the 20 resumed iterations identical to the reference's (loss and grad norm as printed).
# 2. The SIGSTOP case alone (FORMATS= now skips the format runs): rank 0's watchdog ends the job with its message.
# 3. If time is left: 1 under the recipe's full_iteration graphs, torch_dist only.
# Checkpoints live under WORK (/tmp/s26*), outside the packed workdir.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=570
workdir s26_1
export CUDA_VISIBLE_DEVICES=0,1
cd $REPO
step faults_eager 330 env DETERMINISTIC=1 GRAPHS=none FAULT_OVERLAP=signal COMMIT=${COMMIT:-unknown} \
  OUT=$W/faults_eager WORK=/tmp/s26e SKIP_INSTALL=1 bash docs/perf/scripts/run_s10_faults.sh
grep -E "^\| |^- " $W/faults_eager/summary.md 2>/dev/null | cut -c1-300
rm -rf /tmp/s26e
step stall 130 env STALL=1 FORMATS= REFERENCE=0 FAULT_OVERLAP=signal GRAPHS=none COMMIT=${COMMIT:-unknown} \
  OUT=$W/stall WORK=/tmp/s26s SKIP_INSTALL=1 bash docs/perf/scripts/run_s10_faults.sh
grep -E "^\| stall|^- " $W/stall/summary.md 2>/dev/null | cut -c1-300
# last: skipped by its time check when the two steps above used their limits
step faults_graphs 170 env DETERMINISTIC=1 FORMATS=torch_dist FAULT_OVERLAP=signal COMMIT=${COMMIT:-unknown} \
  OUT=$W/faults_graphs WORK=/tmp/s26g SKIP_INSTALL=1 bash docs/perf/scripts/run_s10_faults.sh
grep -E "^\| |^- " $W/faults_graphs/summary.md 2>/dev/null | cut -c1-300
rm -rf /tmp/s26g
cd /tmp
