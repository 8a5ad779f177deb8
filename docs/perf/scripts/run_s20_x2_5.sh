# Session 20's fifth 2-GPU call (an H200 pair, ~4 min: what the budget left): llama3-70b-proxy, 8 layers, local graphs,
# off against cuBLAS over the p2p transports (call 3's H100 pair ran out of memory at this size, both sides), then
# gemm_rs's s 8192 shapes and async_op with the decompose-p2p cases new. Ran as one command line, the same steps.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-320}
workdir s20_x2_5
train l70b8-off 115 GRAPHS=local OVERLAP=off TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
train l70b8-cublas 115 GRAPHS=local OVERLAP=decompose TRANSPORT=p2p TRAIN_ITERS=20 GBS=4 -- \
  $REPO/recipes/llama3-70b-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8-*/train.log
step rs_tests 80 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_gemm_rs_gpu.py -k "s8192 or async" \
  -p no:cacheprovider
grep -E "PASSED|FAILED|passed|failed" $W/rs_tests.out | tail -4
