# Session 36's fifth four-GPU call (~5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s36_x4_5.sh` (carry [".whl"]).
# 1. Issue 20: host time per plan call at t = 2 (GPUs 0-1; session 30's probe; last measured there: gemm_rs p2p
#    74.0 us, ag_gemm p2p 83.9, gemm_ar nccl 105.6, a bare torch.mm 40-50 on that host).
# 2. The 70B proxy at TP 4 (16 layers, local graphs, the recipe's defaults), copy against epilogue, every iteration
#    logged (call 3 logged one iteration per run: copy 1848.3, epilogue 1866.1 ms).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-340}
workdir s36_x4_5
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
CUDA_VISIBLE_DEVICES=0,1 step host_t2 80 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10
grep -E "^op=|memop" $W/host_t2.out | cut -c1-400
i=0
for run in epilogue copy; do
  i=$((i + 1)); extra=(); [[ $run == epilogue ]] && extra=(--overlap-tp-rs-transfer epilogue)
  train l70b16-t4-$run-$i 105 GRAPHS=local TP=4 NPROC=4 NUM_LAYERS=16 OVERLAP=signal TRAIN_ITERS=12 GBS=4 \
    LOG_INTERVAL=1 -- $REPO/recipes/llama3-70b-proxy.sh "${extra[@]}"
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l70b16-t4-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l70b16_t4.md
grep -h -E "Error|error:|Traceback|out of memory" $W/*/train.log | sort | uniq -c | head -8
