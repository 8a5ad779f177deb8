# Session 37 (2 GPUs, `nvidia-h200-x2`; ~6 min): `COMMIT=<sha> bash docs/perf/scripts/run_s37_x2_2.sh` (carry
# [".whl"]). run_s37_x2_1.sh: with a comm stream per plan instance the token split still ran one 8B layer at t = 2,
# micro-batch 2, at 1.054 of the counterfactual against 0.974 unsplit (+1.9 ms per step, +1.5 ms of queued GPU time);
# at t = 2 the ReduceScatter is the epilogue's (nothing on a comm stream), so the queue was not the cause there.
# 1. one replay of each layer profiled (megatron, signal-p2p-inplace, its -split), summarised by kernel class: where
#    the split's extra GPU time goes;
# 2. llama3-8b at TP 2 (8 layers), micro-batch 2 (GBS 8), off / signal (run_s37_x2_1.sh's runs stopped at Megatron's
#    check lr_warmup_iters < train_iters: 10 and 10).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s37_x2_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step layer_t2_prof 150 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --micro-batch 2 --configs megatron,nocomm,signal-p2p-inplace,signal-p2p-inplace-split --reps 6 --rounds 2 \
  --input-sets 2 --profile $W/prof --out $W --name layer_t2_split_prof
grep -E "^\| l8b " $W/layer_t2_split_prof.md | cut -c1-200
for c in nocomm signal-p2p-inplace signal-p2p-inplace-split; do
  python3 $REPO/docs/perf/scripts/trace_summary.py --steps 2 $W/prof/l8b_${c}_graph_rank0.json.gz > $W/prof_$c.txt 2>&1
  echo "== $c"; head -40 $W/prof_$c.txt | cut -c1-150
done
i=0
for run in off signal; do
  i=$((i + 1))
  train l8b8-t2-mbs2-$run-$i 80 GRAPHS=local TP=2 NPROC=2 OVERLAP=$run MBS=2 TRAIN_ITERS=14 GBS=8 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-8b.sh --num-layers 8
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b8-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b8_t2_mbs2.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
