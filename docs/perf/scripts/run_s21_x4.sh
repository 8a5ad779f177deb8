# Session 21's 4-GPU call (~9.5 min; the x4 kinds were lent for the first time since session 6): TP 4, the shape of
# session 6's 70B-proxy figure that the brief quotes (0.92x eager, before graphs, plans and the p2p transports).
# - the ops and layers at t = 4 never ran on GPUs with the p2p transports (CPU simulator only): every op captured and
#   replayed bitwise, gemm_rs / ag_gemm against torch, the layers against Megatron's;
# - llama3-70b-proxy at TP 4, 8 layers, local graphs: off / decompose (cuBLAS over p2p, the recipe's default) /
#   signal. Predicted from session 20's TP 2 figure (1.028x) and the layer benchmark: at t = 4 each GEMM is half as
#   long and each collective moves 3/4 instead of 1/2 of its tensor, so the share of communication and the gain
#   are larger if the overlap hides it (1.03-1.06x), smaller if the shorter GEMMs no longer cover their transfers;
# - the layer under graphs at t = 4 (the span per layer step and the no-communication counterfactual).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s21_x4
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -4
step tests_t4 150 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_graphs_gpu.py \
  $REPO/tests/gpu/test_gemm_rs_gpu.py $REPO/tests/gpu/test_ag_gemm_gpu.py $REPO/tests/gpu/test_layers_gpu.py \
  -k "every_op_replays or test_gemm_rs or test_ag_gemm or linears_match or sum_in_the_norm" -p no:cacheprovider \
  --durations=0
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/tests_t4.out | grep -v "^\.\./" | tail -14
train l70b8t4-off 120 TP=4 NPROC=4 GRAPHS=local OVERLAP=off TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
train l70b8t4-decompose 120 TP=4 NPROC=4 GRAPHS=local OVERLAP=decompose TRAIN_ITERS=20 GBS=4 -- \
  $REPO/recipes/llama3-70b-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8t4-*/train.log | tee $W/l70b8t4.md
grep -h -E "Error|error:|Traceback|OutOfMemory" $W/*/train.log | sort | uniq -c | head -8
step layer_t4 110 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l70b,l8b \
  --configs megatron,nocomm,off,signal-p2p,decompose-p2p --reps 40 --rounds 6 --out $W --name layer_t4
grep -E "^\| |^- " $W/layer_t4.md | cut -d'|' -f1-10 | head -12
train l70b8t4-signal 120 TP=4 NPROC=4 GRAPHS=local OVERLAP=signal TRAIN_ITERS=20 GBS=4 -- \
  $REPO/recipes/llama3-70b-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8t4-*/train.log | tee $W/l70b8t4.md
