# The next session's first call (2 GPUs; ~9 min), written in session 26. Pass the commit as a literal:
# `COMMIT=<sha> bash docs/perf/scripts/run_s27_1.sh` (on the device `git rev-parse` read stale metadata in s26).
# 1. Issue 25's Zipf figure at the proxy (s26: 1.145x, target 1.15x): the expert ops with 2 comm SMs, which bench
#    moe's sweep found best on every proxy row (s26/moe_ops_proxy.md) and the layer sweep never tried; predicted
#    ~0.7 ms of 47.8 per layer step (Zipf ~1.16x). The first pass names the kernels a new routing compiles
#    and counts its device allocations (s26: signal 448 ms per step on Zipf, 48 warm; which of the two is it?).
# 2. The same variants over NVLink: a new default must not lose there (s20: signal 0.97 / 1.00 of Megatron's).
# 3. Issue 21: the smoke layer gains 1/0.902 at TP 2 under graphs (s26/layer_smoke_t2.md; ~1.045x predicted end to
#    end) while the recipe measured a tie (s20): one smoke step profiled off / signal under full_iteration graphs,
#    rank 0, summarised per kernel class and kernel (where does the layer's gain go?).
# 0. First (1 min): issue 20's host time per plan call at t = 2 on the H200 pair (after session 23's hot-path changes
#    it was measured on H100 hosts only, where a bare torch.mm took 63-70 us of host time).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s27_1
export CUDA_VISIBLE_DEVICES=0,1
step host_t2 60 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10
grep -v "^W1\|^\*\|Warning\|warn" $W/host_t2.out | head -30 | cut -c1-250
V=signal,signal.sm2,signal.g4.sm2,signal.g8.sm2,off
step moe_proxy_sm2 170 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --routing zipf,uniform --methods $V --reps 32 --rounds 8 --out $W --name moe_layer_proxy_sm2
grep -E "^\| " $W/moe_layer_proxy_sm2.md | cut -c1-500
step moe_nvlink_sm2 150 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --routing zipf,uniform --methods $V --reps 32 --rounds 8 --out $W --name moe_layer_nvlink_sm2
grep -E "^\| " $W/moe_layer_nvlink_sm2.md | cut -c1-500
for mode in off signal; do
  train smoke-$mode-prof 90 OVERLAP=$mode TRAIN_ITERS=24 -- $REPO/recipes/smoke.sh \
    --profile --use-pytorch-profiler --profile-step-start 22 --profile-step-end 23 --profile-ranks 0
  # megatron-core 0.19.2 (training.py) exports the profiled steps to <tensorboard dir>/../torch_profile/rank-<r>.json.gz
  trace=$W/smoke-$mode-prof/torch_profile/rank-0.json.gz
  python3 $REPO/docs/perf/scripts/trace_summary.py --steps 1 --top 30 $trace > $W/smoke_${mode}_step_summary.md 2>&1
  head -12 $W/smoke_${mode}_step_summary.md
  if (( $(stat -c %s $trace 2>/dev/null || echo 0) < 40000000 )); then mv $trace $W/smoke_${mode}_step.json.gz; fi
  rm -rf $W/smoke-$mode-prof/torch_profile
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/smoke-*/train.log | sed "s#$W/##" | tee $W/smoke.md
