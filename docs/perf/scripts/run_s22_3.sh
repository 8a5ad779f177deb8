# Session 22's third call (~9.5 min), written in session 20, reordered in 22 (faults first, with the SIGSTOP case).
# With 4 GPUs, GPUs 0-1.
# - issue 25: the MoE layer on the cross-node proxy (NCCL_P2P_DISABLE=1: session 13 1.16 / 1.12x), --overlap-moe auto
#   next to signal and off; the mixtral-proxy recipe signal vs off (4 layers: 8 layers' experts do not fit with Adam at
#   EP 2), loss over 20 steps;
# - issue 24: the torch_dist fault under full_iteration graphs (45 s in session 13 against a 30 s limit), with the
#   job's processes and stacks recorded if it outlives the limit (run_s10_faults.sh), deterministic mode; then a rank
#   stopped by SIGSTOP mid-step (STALL=1: rank 0's watchdog must end the job).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-560}
workdir s22_3
export CUDA_VISIBLE_DEVICES=0,1
cd $REPO
step faults 260 env STALL=1 COMMIT=${COMMIT:-unknown} OUT=$W/faults WORK=/tmp/s21 SKIP_INSTALL=1 GRAPHS=full_iteration \
  FORMATS=torch_dist DETERMINISTIC=1 bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
tail -12 $W/faults/summary.md 2>/dev/null; cat $W/faults/*_stuck.txt 2>/dev/null | head -40
step moe_proxy 150 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --methods signal,off,auto --out $W --name moe_layer_proxy
grep -E "^\| |^- " $W/moe_layer_proxy.md | head -8
train mixtral-off 100 GRAPHS=local OVERLAP=off NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/mixtral-proxy.sh
train mixtral-signal 100 GRAPHS=local OVERLAP=signal NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/mixtral-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/mixtral-*/train.log | tee $W/mixtral.md
# if the time allows: the smoke's layer (s 2048, micro-batch 2), where the GEMMs are shorter than their collectives:
# how much communication there is to hide at all (nocomm)
step layer_smoke 80 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models smoke --seq 2048 \
  --micro-batch 2 --configs megatron,nocomm,off,signal-p2p,decompose-p2p --reps 60 --rounds 8 --out $W \
  --name layer_smoke
grep -E "^\| |^- " $W/layer_smoke.md | cut -d'|' -f1-10 | head -10
