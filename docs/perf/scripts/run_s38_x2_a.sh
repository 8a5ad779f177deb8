# Session 38 (2 GPUs, `nvidia-h200-x2`; ~9 min): `COMMIT=<sha> bash docs/perf/scripts/run_s38_x2_a.sh` (carry
# [".whl"]). The token split (session 37) lost on the 8B / 70B layers, where the unsplit layer at a micro-batch of 2
# already sits at its counterfactual. The smoke's layer is the other end: every collective outlasts its GEMM (s28),
# nocomm 0.692 of Megatron's against signal-p2p 0.902 (s26), and its micro-batch is 2 already: the one shape where
# one half's transfers have the other half's attention, norms and GEMMs to hide under. Predicted: the split below the
# unsplit layer there if its own cost (half-row GEMMs, the wgrad sums, the joins) stays under the ~0.2 of Megatron's
# layer that communication still exposes.
# 1. one smoke layer under graphs (s 2048, micro-batch 2): megatron, nocomm, off / auto / signal-p2p, each split;
# 2. the smoke end to end (full_iteration graphs): off, auto, auto with TOKEN_SPLIT=1, in alternating order, from
#    session 34's tune cache (the split's half shapes are tuned by its first run); what does not fit is skipped.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s38_x2_a
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step layer_smoke 170 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models smoke --seq 2048 \
  --micro-batch 2 --configs megatron,nocomm,off,off-split,auto,auto-split,signal-p2p,signal-p2p-split --reps 60 \
  --rounds 4 --out $W --name layer_smoke_split
grep -E "^\| smoke " $W/layer_smoke_split.md | cut -c1-200
python3 - $REPO/docs/perf/s34/smoke_tune.json $W/tune.json "$(head -1 $W/cards.txt)" <<'PY'
import json, sys
cache = json.load(open(sys.argv[1]))
cache["entries"] = {sys.argv[3] + k[k.index("|"):]: dict(v, stamp=dict(v["stamp"], device=sys.argv[3]))
                    for k, v in cache["entries"].items()}
json.dump(cache, open(sys.argv[2], "w"), indent=1)
PY
i=0
for order in "off auto split" "split auto off"; do
  i=$((i + 1))
  for run in $order; do
    limit=62; [[ $i == 1 && $run != auto ]] && limit=110   # the first run compiles, the split's first run tunes
    mode=auto; [[ $run == off ]] && mode=off
    split=0; [[ $run == split ]] && split=1
    train smoke-$run-$i $limit OVERLAP=$mode TOKEN_SPLIT=$split TUNE_CACHE=$W/tune.json TRAIN_ITERS=40 \
      LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | cut -c1-120 | tee $W/smoke.md
grep -h "\[overlap_tp\] auto:" $W/smoke-split-1/train.log | sort -u | cut -c1-160
grep -h -i "token split\|warn" $W/smoke-split-1/train.log | sort | uniq -c | head -8
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
