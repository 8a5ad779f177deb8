# Written in session 35 for the next session (2 GPUs, `nvidia-h200-x2`; ~8 min): `COMMIT=<sha> bash
# docs/perf/scripts/run_s36_x2_1.sh` (carry [".whl"]).
# 1. Issue 20: host time per plan call at t = 2 (session 30's probe; last measured there: gemm_rs p2p 74.0 us, ag_gemm
#    p2p 83.9, gemm_ar nccl 105.6, a bare torch.mm 40-50 on the same host). Since then the AllGather's SM pulls
#    (10 driver calls per call against 14 on the copy engines, probe_hot_path_cpu.py) and nothing else on that path.
# 2. Issue 21: the smoke, off / auto, three rounds in alternating order, a fresh tune cache per machine (its first
#    auto run tunes: given 110 s).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s36_x2_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step host_t2 80 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10
grep -E "^op=|memop" $W/host_t2.out | cut -c1-400
i=0
for order in "off auto" "auto off" "off auto"; do
  i=$((i + 1))
  for run in $order; do
    limit=62; [[ $i == 1 ]] && limit=110   # the machine's first runs compile, and auto's first run tunes
    train smoke-$run-$i $limit OVERLAP=$run TUNE_CACHE=$W/tune.json TRAIN_ITERS=40 LOG_INTERVAL=2 -- \
      $REPO/recipes/smoke.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | cut -c1-120 | tee $W/smoke.md
grep -h "\[overlap_tp\] auto:" $W/smoke-auto-1/train.log | sort -u | cut -c1-160
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
