# Session 37 (2 GPUs, `nvidia-h200-x2`; ~8 min; no 4-GPU kind was lent for run_s37_x4_3.sh): `COMMIT=<sha> bash
# docs/perf/scripts/run_s37_x2_1.sh` (carry [".whl"]). run_s37_x4_2.sh measured the token split on one comm stream:
# one 8B layer at micro-batch 2, t = 2: 1.048 of the counterfactual against 0.970 unsplit (t = 4 1.094 / 1.007). Read:
# half B's AllGather pulls queued behind half A's transfers on the one comm stream, so B's GEMMs waited for both. Now
# each plan instance has its own comm stream. Predicted at t = 2: the split near the unsplit layer (0.97-1.00), not
# below it (the unsplit layer is at its counterfactual at t = 2 since session 29).
# 1. the split's GPU tests at t = 2 (small signal / decompose; the 8B shape with a late peer);
# 2. one 8B layer at t = 2, micro-batch 2, graphs: signal-p2p-inplace against its -split, 3 rounds;
# 3. llama3-8b at TP 2 (8 layers), micro-batch 2 (GBS 8), off / signal / off / signal: the recipe's defaults at the
#    micro-batch of 2 (the 8-layer model at micro-batch 1: 1.025x in session 34).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s37_x2_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step split_tests_t2 150 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "token_split"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/split_tests_t2.out | grep -v "^\.\./" | cut -c1-300 | tail -4
step layer_t2 120 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --micro-batch 2 --configs megatron,nocomm,signal-p2p-inplace,signal-p2p-inplace-split --reps 12 --rounds 3 \
  --out $W --name layer_t2_split_streams
grep -E "^\| l8b " $W/layer_t2_split_streams.md | cut -c1-200
i=0
for run in off signal off signal; do
  i=$((i + 1))
  train l8b8-t2-mbs2-$run-$i 75 GRAPHS=local TP=2 NPROC=2 OVERLAP=$run MBS=2 TRAIN_ITERS=10 GBS=8 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-8b.sh --num-layers 8
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 3 $W/l8b8-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b8_t2_mbs2.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
