# Session 26's last call (2 GPUs; ~3 min): issue 25's Zipf figure at the proxy again, now that bench moe_layer runs
# every routing once per variant before its timed rounds (run_s26_4: one round of signal's Zipf at 0.15x, the
# first pass's compiles inside a timed round); signal and off only, more rounds.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=230
workdir s26_7
export CUDA_VISIBLE_DEVICES=0,1
step moe_proxy 200 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --routing zipf,uniform --methods signal,off --reps 40 --rounds 8 --out $W --name moe_layer_proxy
grep -E "^\| " $W/moe_layer_proxy.md | cut -c1-400
