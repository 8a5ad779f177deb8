# Session 30's third call (2 GPUs; ~8 min): `COMMIT=<sha> bash docs/perf/scripts/run_s30_4.sh` (carry [".whl"]).
# The smoke under full_iteration graphs, auto against off, four interleaved rounds in alternating order. auto led
# signal in all four rounds of sessions 28-30 that ran both (by 7%, 7%, 1%, 5.5%); its ratio to off was 1.011,
# 1.081, 1.062 and 1.144. This call gives the median over more pairs, for issue 21's 1.10x target and the smoke's
# default mode. The first auto run compiles and tunes (call 2's first auto run was cut at 66 s): a longer limit.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s30_4
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
i=0
for order in "auto off" "off auto" "auto off" "off auto"; do
  i=$((i + 1))
  for mode in $order; do
    limit=62; [[ $mode == auto && $i == 1 ]] && limit=100
    train smoke-$mode-$i $limit OVERLAP=$mode TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*-[1-4]/train.log | sed "s#$W/##" | tee $W/smoke.md
grep -h "\[overlap_tp\] auto:" $W/smoke-auto-1/train.log | sort | uniq | head -12 | cut -c1-200
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
