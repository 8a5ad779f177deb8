# Written in session 34 for the next session (2 GPUs, `nvidia-h200-x2`; ~7 min): `COMMIT=<sha> bash
# docs/perf/scripts/run_s35_x2_1.sh` (carry [".whl"]). Session 34's profiled smoke step (docs/perf/s34/README.md)
# still exposes 2.0 ms of NCCL AllGathers under auto, qkv's among them: the tuner keeps qkv's AllGather `off` (0.0496
# ms) over the SM pulls (p2p/sm16 0.0506, +2%), deciding the forward op alone, while a p2p AllGather also moves the
# backward's re-gather of qkv's input from NCCL to the copy engines (or removes it, gathering in place). The hypothesis
# without a code change: auto from session 34's tune cache, and from a copy whose qkv decision is p2p/sm16, with and
# without --overlap-tp-gather-in-place, against off, two rounds in alternating order. Predicted: qkv on p2p -0.3 to
# -0.5 ms per step (16 exposed NCCL re-gathers of ~33 us each, less 16 x 1 us forward); in place another -0.2 to -0.3
# (fc1's and qkv's re-gathers gone) - inside one pair's noise, so read the four runs of each side together. If it holds:
# the tuner's AllGather decision should count the backward's re-gather (tune/__init__.py decide()).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s35_x2_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
python3 - $REPO/docs/perf/s34/smoke_tune.json $W/tune_auto.json $W/tune_qkv_p2p.json "$(head -1 $W/cards.txt)" <<'PY'
import json, sys
cache = json.load(open(sys.argv[1]))
# session 34's decisions were measured on H200s; on other cards the keys take the card's name (the decisions as they
# are: the experiment is about qkv's decision, not about re-measuring the others)
cache["entries"] = {sys.argv[4] + k[k.index("|"):]: dict(v, stamp=dict(v["stamp"], device=sys.argv[4]))
                    for k, v in cache["entries"].items()}
json.dump(cache, open(sys.argv[2], "w"), indent=1)
entries = cache["entries"]
qkv = next(k for k in entries if "|ag|" in k and "|4096x768x1024|" in k)
fc1 = next(k for k in entries if "|ag|" in k and "|4096x2816x1024|" in k)   # its decision is p2p/sm16
entries[qkv] = dict(entries[qkv], config=dict(entries[fc1]["config"]), label="p2p/sm16", how="edited (session 34)")
json.dump(cache, open(sys.argv[3], "w"), indent=1)
print("qkv:", entries[qkv]["label"], entries[qkv]["config"]["comm_sms"], entries[qkv]["config"]["transport"])
PY
i=0
for order in "off auto qkvp2p qkvp2p-inplace" "qkvp2p-inplace qkvp2p auto off"; do
  i=$((i + 1))
  for run in $order; do
    limit=62; [[ $i == 1 && $run == off ]] && limit=110   # the machine's first run compiles
    extra=(); [[ $run == *inplace ]] && extra=(--overlap-tp-gather-in-place)
    cache=$W/tune_auto.json; [[ $run == qkvp2p* ]] && cache=$W/tune_qkv_p2p.json
    mode=auto; [[ $run == off ]] && mode=off
    train smoke-$run-$i $limit OVERLAP=$mode TUNE_CACHE=$cache TRAIN_ITERS=40 LOG_INTERVAL=2 -- \
      $REPO/recipes/smoke.sh "${extra[@]}"
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | cut -c1-120 | tee $W/smoke.md
grep -h "\[overlap_tp\] auto: ag" $W/smoke-qkvp2p-1/train.log | sort -u | cut -c1-160
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
