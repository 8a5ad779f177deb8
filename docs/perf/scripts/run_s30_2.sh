# The next session's second call (4 GPUs, `nvidia-h200-x4` with needs_h200; ~9 min), written in session 29, if a
# four-GPU kind is lent: `COMMIT=<sha> bash docs/perf/scripts/run_s30_2.sh` (carry [".whl"]). Gathering in place at
# TP 4, where the layer is far from its no-communication counterfactual (session 21, 8B: ours 0.964 of Megatron's
# layer, nocomm 0.841): each stage copy there is a quarter of the 2-GPU one's bytes, but the copies sit on a
# communication-bound path. Predicted: in place 1-2% faster per 8B layer at t = 4 (the copies' share of the
# layer: 4 x ~8 us of ~3.3 ms, plus the backward re-gathers beside the dgrad GEMMs).
# 1. One layer fwd + bwd under graphs at t = 4, s 8192: 8B and 70B, signal-p2p / decompose-p2p with and without.
# 2. The 70B proxy at TP 4 (16 layers, local graphs): off, decompose, decompose in place (session 21: 1.009x).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s30_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step layer_t4 230 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b,l70b --seq 8192 \
  --configs megatron,nocomm,signal-p2p,signal-p2p-inplace,decompose-p2p,decompose-p2p-inplace --reps 16 --rounds 4 \
  --out $W --name layer_t4_inplace
grep -E "^\| l(8|70)b " $W/layer_t4_inplace.md | cut -c1-200
for run in decompose decompose-inplace off; do
  extra=(); [[ $run == *inplace ]] && extra=(--overlap-tp-gather-in-place)
  mode=${run%-inplace}
  train l70b16-t4-$run 110 GRAPHS=local TP=4 NPROC=4 NUM_LAYERS=16 OVERLAP=$mode GATHER_IN_PLACE=0 TRAIN_ITERS=14 \
    GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh "${extra[@]}"
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 6 $W/l70b16-*/train.log | sed "s#$W/##" | tee $W/l70b16_t4.md
grep -h -E "Error|error:|Traceback|OutOfMemory" $W/*/train.log | sort | uniq -c | head -8
