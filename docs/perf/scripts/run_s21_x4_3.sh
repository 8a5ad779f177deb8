# Session 21's third call on the 4-GPU H200 machine (~6 min): why the overlap gains ~nothing at t = 4 (call 1: the
# layer's no-communication counterfactual 0.848 / 0.948 of Megatron's at 8B / 70B, ours 0.989 / 0.996; the 70B proxy
# end to end 1.00x): each op under graphs at t = 4 against sequential cuBLAS + NCCL, GEMM alone and collective alone;
# the 8B layer profiled (one replay per configuration, rank 0's trace summarised); the rest of the t = 4 tests.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s21_x4_3
step ops_t4 150 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops rs,ag --seq 8192 --ag-seq 8192 \
  --reps 30 --out $W --name ops_t4_graphs
grep -E "^\| " $W/ops_t4_graphs.md
step layer_prof_t4 100 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b \
  --configs megatron,nocomm,signal-p2p,decompose-p2p --reps 40 --rounds 4 --profile $W/prof --out $W --name layer_prof_t4
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 --top 16 $W/prof/l8b_*_graph_rank0.json.gz \
  > $W/layer_trace_summary_t4.md 2>&1; grep -E "^## |^per step|^GPU time" $W/layer_trace_summary_t4.md
rm -f $W/prof/*rank[123]*
step tests_t4b 150 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_ag_gemm_gpu.py \
  $REPO/tests/gpu/test_layers_gpu.py -k "test_ag_gemm or linears_match or sum_in_the_norm" -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/tests_t4b.out | grep -v "^\.\./" | tail -12
