# The next session's third call (2 GPUs; ~7 min), written in session 29: `COMMIT=<sha> bash docs/perf/scripts/run_s30_3.sh`
# (carry [".whl"]). The smoke under full_iteration graphs, off / signal / auto, two rounds in new orders. auto led
# signal in all three rounds of sessions 28-29 (by 7%, 7% and 1%); a lead in both rounds here makes auto the smoke's
# default (README's main job; its tuning adds ~7 s before the first step).
# Added in session 30: host time per plan call at t = 2 after session 29's host-path changes (issue 20; s28: gemm_rs
# p2p 61.3 us, ag_gemm p2p 89.1: predicted -2 to -5 us each, one and two driver calls fewer), and the smoke gathering
# in place for its training log's symmetric-memory line (call 1's 50 s limit ended that run before iteration 1).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s30_3
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step host_t2 70 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10
grep -E "^(t = |op=)" $W/host_t2.out | cut -c1-400
i=0
for order in "auto signal off" "signal off auto"; do
  i=$((i + 1))
  for mode in $order; do
    train smoke-$mode-$i 68 OVERLAP=$mode TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
  done
done
train smoke-inplace 60 OVERLAP=signal TRAIN_ITERS=12 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh --overlap-tp-gather-in-place
grep -h "symmetric memory" $W/smoke-inplace/train.log | head -2 | cut -c1-300
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*-[12]/train.log | sed "s#$W/##" | tee $W/smoke.md
grep -h "\[overlap_tp\] auto:" $W/smoke-auto-1/train.log | sort | uniq | head -12 | cut -c1-200
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
