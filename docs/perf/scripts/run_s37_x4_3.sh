# Session 37 (4 GPUs, `nvidia-h200-x4`; ~8 min): `COMMIT=<sha> bash docs/perf/scripts/run_s37_x4_3.sh` (carry
# [".whl"]). run_s37_x4_2.sh measured the token split on one comm stream: one 8B layer at t = 4, micro-batch 2, 1.094 of
# the counterfactual against 1.007 unsplit (70B 1.006 / 0.958; t = 2 1.048 / 0.970). Read: half B's AllGather pulls
# queued behind half A's ReduceScatter pushes on the one comm stream, so B's GEMMs waited for both (~200 us per edge at
# t = 4, ~1 ms per layer step). Now each plan instance has its own comm stream. Predicted: the split near the
# unsplit layer (1.00-1.03), not below it: at micro-batch 2 the unsplit layer is already at 1.007.
# 1. the split's GPU tests at t = 4 (small, signal; the 8B shape with a late peer, which run_s37_x4_2.sh had no time
#    left for);
# 2. one 8B layer at t = 4, micro-batch 2, graphs: signal-p2p-inplace-dw against its -split, 3 rounds;
# 3. llama3-8b at TP 4 on a micro-batch of 2 (GBS 8: 4 micro-batches), off / signal, one pair: the recipes' defaults
#    at the micro-batch where the layer reached its counterfactual.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s37_x4_3
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step split_tests_t4 150 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "token_split and (signal or late_peer)"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/split_tests_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -4
step layer_t4 150 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --micro-batch 2 --configs megatron,nocomm,signal-p2p-inplace-dw,signal-p2p-inplace-dw-split --reps 12 --rounds 3 \
  --out $W --name layer_t4_split_streams
grep -E "^\| l8b " $W/layer_t4_split_streams.md | cut -c1-200
i=0
for run in off signal; do
  i=$((i + 1))
  train l8b32-t4-mbs2-$run 120 GRAPHS=local TP=4 NPROC=4 OVERLAP=$run MBS=2 TRAIN_ITERS=9 GBS=8 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-8b.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 3 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t4_mbs2.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
