# The next session's THIRD call (~8 min; 2 GPUs are enough: GPUs 0-1), written in session 22.
# - issue 25: mixtral-proxy with the overlap on, eager (session 22: off 481.9 ms/iteration; signal did not log its
#   first iteration within 111 s); a 240 s limit, and stacks at the limit (train() sends SIGABRT 8 s before it).
# - issue 22 (if the time allows): the high-communication proxy layer (mid-size model, NCCL through host memory);
#   issue 21: the smoke's layer with its counterfactual and the SM pulls.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s23_3
export CUDA_VISIBLE_DEVICES=0,1
for mode in off signal; do   # the same machine for both sides; signal's first iteration compiles the MoE kernels
  train mixtral-$mode 240 OVERLAP=$mode NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1 -- $REPO/recipes/mixtral-proxy.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/mixtral-*/train.log | tee $W/mixtral.md
grep -E "Traceback|Error|File \"" $W/mixtral-signal.out | head -30
# if the time allows, issue 22's high-communication proxy (BENCHMARKS.md): the mid-size layer (h 3072, s 4096) with
# NCCL through host memory (NCCL_P2P_DISABLE=1, ~20 GB/s) and the NCCL transports only (p2p would bypass the proxy)
step layer_mid_proxy 120 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs \
  --models mid --seq 4096 --configs megatron,nocomm,off,signal,decompose --reps 30 --rounds 6 --out $W \
  --name layer_mid_proxy
grep -E "^\| " $W/layer_mid_proxy.md | cut -d'|' -f1-10 | head -8
# if the time allows, issue 21's smoke target (>= 1.10x; a tie so far): the smoke's layer, where the GEMMs are shorter
# than their collectives: how much communication there is to hide at all (nocomm), and the SM pulls there
step layer_smoke 80 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models smoke --seq 2048 \
  --micro-batch 2 --configs megatron,nocomm,off,signal-p2p,signal-p2p-sm16,decompose-p2p --reps 60 --rounds 8 \
  --out $W --name layer_smoke
grep -E "^\| |^- " $W/layer_smoke.md | cut -d'|' -f1-10 | head -10
