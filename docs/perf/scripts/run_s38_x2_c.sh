# Session 38 (2 GPUs, `nvidia-h200-x2`; ~7 min): `COMMIT=<sha> bash docs/perf/scripts/run_s38_x2_c.sh` (carry
# [".whl"]). Issue 22's measurements not yet made:
# 1. the token split at the high-communication proxy (BENCHMARKS.md: the mid-size layer, s 4096, NCCL slowed by
#    NCCL_P2P_DISABLE=1, NCCL transports only), micro-batch 2: the one shape left where communication (61% of
#    Megatron's layer, s25) outlasts compute, so one half's collectives have the other half's attention, norms and
#    GEMMs to run under. Predicted: signal-split below signal (1.026 of Megatron's at micro-batch 1 in s25) if NCCL
#    serialises the two instances' collectives behind each other rather than behind the GEMMs;
# 2. llama3-70b-proxy (8 layers, TP 2, local graphs, the recipe's decompose in place) with the fused block on and off
#    (--no-overlap-tp-fused-norms, staged), 20 iterations each at a tenth of the recipe's learning rate (session 32: at
#    its own rate the short schedule's grad-norm spike makes any two runs part for a while): speed and loss at every
#    iteration.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s38_x2_c
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step mid_proxy_split 200 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs \
  --models mid --seq 4096 --micro-batch 2 \
  --configs megatron,nocomm,off,off-split,signal,signal-split,decompose,decompose-split --reps 20 --rounds 3 \
  --out $W --name layer_mid_proxy_split
grep -E "^\| mid " $W/layer_mid_proxy_split.md | cut -c1-200
train l70b8-fused 140 GRAPHS=local TP=2 NPROC=2 TRAIN_ITERS=20 LOG_INTERVAL=1 -- $REPO/recipes/llama3-70b-proxy.sh \
  --lr 1.5e-5 --min-lr 1.5e-6
train l70b8-unfused 140 GRAPHS=local TP=2 NPROC=2 TRAIN_ITERS=20 LOG_INTERVAL=1 GATHER_IN_PLACE=0 -- \
  $REPO/recipes/llama3-70b-proxy.sh --no-overlap-tp-fused-norms --lr 1.5e-5 --min-lr 1.5e-6
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l70b8-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l70b8_fused.md
for d in $W/l70b8-*/; do echo "$(basename $d): $(grep -o 'lm loss: [0-9.E+-]*' $d/train.log | awk '{printf "%s ", $3}')"; done
grep -h -E "Error|error:|Traceback|out of memory" $W/*/train.log | sort | uniq -c | head -8
