# Session 21's fourth call on the 4-GPU H200 machine (~8 min, the budget's rest), after two changes made from
# call 3's profile: (1) the p2p AllGather's pulls read the peers in ring order (rank+1 first; every rank read rank 0
# first before, so t-1 pullers shared one rank's NVLink egress), lanes starting at different peers; (2) the signaled
# p2p ReduceScatter's row slices visit the owners in ring order (own region last), as cuBLAS's RegionGemms did already.
# Predicted at t = 4: ag l8b.qkv 0.360 -> ~0.22 ms (the pulls ~2x faster; async-TP 0.217), l70b.qkv 0.679 -> ~0.5;
# the layer's signal-p2p from 0.989 / 0.996 of Megatron's toward nocomm's 0.848 / 0.948; the 70B proxy at TP 4
# above off's 1027 ms. Then the t = 4 tests of the changed paths (gemm_ar with the differing elements counted).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-525}
workdir s21_x4_4
step ops_t4 60 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops rs,ag --seq 8192 --ag-seq 8192 \
  --reps 30 --out $W --name ops_t4_graphs
grep -E "^\| " $W/ops_t4_graphs.md | cut -d'|' -f1-13
step layer_t4 100 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,nocomm,signal-p2p,signal-p2p-lanes2,decompose-p2p --reps 40 --rounds 6 --out $W --name layer_t4
grep -E "^\| " $W/layer_t4.md | cut -d'|' -f1-10 | head -12
for mode in off signal decompose; do
  train l70b8t4-$mode 110 TP=4 NPROC=4 GRAPHS=local OVERLAP=$mode TRAIN_ITERS=20 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l70b8t4-*/train.log | tee $W/l70b8t4.md
step tests_t4 100 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_gemm_rs_gpu.py \
  $REPO/tests/gpu/test_ag_gemm_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  -k "test_gemm_rs[s8192] or test_gemm_rs[odd] or test_gemm_ar or test_ag_gemm[s8192] or every_op_replays" \
  -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed|differ" $W/tests_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -12
step ops_t2 50 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops rs,ag \
  --seq 8192 --ag-seq 8192 --reps 30 --out $W --name ops_t2_graphs
grep -E "^\| " $W/ops_t2_graphs.md | cut -d'|' -f1-13
