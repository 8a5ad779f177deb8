# Session 26's second call (2 GPUs; ~9 min). 1. Issue 24's SIGSTOP case alone: run_s26_1's step got 130 s, less than
# start-up + 12 eager iterations (~50 s) + the watchdog (20 s) + torchrun's shutdown (<= 40 s) + the script's margin
# (15 s) can take; it was cut while waiting and left no log. Now 220 s, and its working folder (no checkpoints: no
# --save in the stall run) inside the packed workdir so the training log comes back either way.
# 2. Issue 25's Zipf figure at the proxy (s22: 1.13x, target 1.15x): the expert ops' groups and comm SMs swept
#    (bench moe_layer's .gN / .smN variants; `signal` is the launchers' groups=2, comm_sms=4), both routings.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=580
workdir s26_4
export CUDA_VISIBLE_DEVICES=0,1
cd $REPO
step stall 220 env STALL=1 FORMATS= REFERENCE=0 FAULT_OVERLAP=signal GRAPHS=none COMMIT=${COMMIT:-unknown} \
  OUT=$W/stall WORK=$W/stall_work SKIP_INSTALL=1 bash docs/perf/scripts/run_s10_faults.sh
grep -E "^\| stall|^- " $W/stall/summary.md 2>/dev/null | cut -c1-400
cd /tmp
step moe_sweep 300 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --routing zipf,uniform --methods signal,signal.g3,signal.g4,signal.sm8,signal.g4.sm8,off \
  --out $W --name moe_layer_proxy_sweep
grep -E "^\| |^- " $W/moe_layer_proxy_sweep.md | cut -c1-400 | head -20
