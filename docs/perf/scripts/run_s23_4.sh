# Session 23's fourth call (2 GPUs; ~6 min). run_s23_3.sh's mixtral-proxy with the overlap on hung at its first
# iteration, a rank in ncclGroupEnd inside the signaled dispatch: NCCL connecting the send/receive peers at the first
# exchange, beside a GEMM spinning on that exchange. The MoE ops now connect them first (Communicator.connect_peers).
# Here: the GPU test of exactly that (a fresh process's first exchange is a signaled dispatch over NCCL with its GEMM
# enqueued first), then mixtral-proxy eager with the overlap on, then off (the same machine).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=360
workdir s23_4
export CUDA_VISIBLE_DEVICES=0,1
step first_exchange 90 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_moe_ops_gpu.py \
  -k first_exchange -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/first_exchange.out | grep -v "^\.\./" | cut -c1-300 | tail -4
train mixtral-signal 150 OVERLAP=signal NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1 -- \
  $REPO/recipes/mixtral-proxy.sh
train mixtral-off 90 OVERLAP=off NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1 -- $REPO/recipes/mixtral-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/mixtral-*/train.log | tee $W/mixtral.md
grep -E "overlap_tp\]|Traceback|Error" $W/mixtral-signal/train.log | grep -v "^\[overlap_tp\]   " | cut -c1-300 | head -12
