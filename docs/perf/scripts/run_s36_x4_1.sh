# Written in session 35 for the next session (4 GPUs, `nvidia-h100-x4` or `nvidia-h200-x4`; ~8 min): `COMMIT=<sha>
# bash docs/perf/scripts/run_s36_x4_1.sh` (carry [".whl"]). After the AllGathers' pulls one peer per chunk (session
# 35: one 8B layer at t = 4 1.037 of the no-communication counterfactual on four H100s, issue 22 asks <= 1.02):
# 1. one 8B layer at t = 4 under graphs, the default (in place, deferred wgrad, by peer) against nocomm and Megatron,
#    profiled (one replay each): where its remaining ~0.22 ms over the counterfactual sits (session 32's profile, by
#    rows: 0.483 of 0.665 ms at the attention block's four edges);
# 2. llama3-8b at TP 4 (32 layers, local graphs) off / the defaults / off / the defaults: the end-to-end ratio on
#    these cards (session 33's 1.072x ran on H200s, by rows).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s36_x4_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step layer_t4 130 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --configs megatron,nocomm,signal-p2p-inplace-dw --reps 16 --rounds 2 --out $W --name layer_t4_prof --profile $W/prof
grep -E "^\| l8b " $W/layer_t4_prof.md | cut -c1-200
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 $W/prof/*_graph_rank0.json.gz > $W/layer_t4_prof_trace.txt 2>&1
grep -E "^## |per step" $W/layer_t4_prof_trace.txt
i=0
for run in off signal off signal; do   # ~100 s each on a warm machine
  i=$((i + 1))
  train l8b32-t4-$run-$i 115 GRAPHS=local TP=4 NPROC=4 OVERLAP=$run TRAIN_ITERS=11 GBS=8 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-8b.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t4.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
