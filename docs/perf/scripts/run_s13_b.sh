# Session 13, call 2 (nvidia-h200-x2): SDPAttention under --deterministic-mode (one GPU) and the two bitwise
# layer tests on it; the ops under graphs with host time again (call 1's run aborted in the third shape: the
# watchdog thread freed an evicted plan's symmetric memory during a capture, fixed); the layer under graphs
# with the p2p sum in the norm kernel, profiled, 12 interleaved rounds.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s13_b && mkdir -p $W/prof
step gpu_tests 120 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_attention_gpu.py $REPO/tests/gpu/test_layers_gpu.py \
  -k "deterministic or p2p_sum or mlp_boundary" -p no:cacheprovider
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.out | tail -8
step ops 150 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --host --ops rs,ag --seq 8192 \
  --ag-seq 8192 --reps 30 --out $W --name ops_t2_graphs
grep -E "^\| (rs|ag)|median" $W/ops_t2_graphs.md
step layer 260 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,nocomm,off,signal-agp2p,signal-p2p --reps 60 --rounds 12 --profile $W/prof --out $W --name layer_graphs
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 --top 24 $W/prof/*_graph_rank0.json.gz > $W/trace_summary.md 2>&1
grep -E "^\| l|^- l" $W/layer_graphs.md; grep -A1 "^## " $W/trace_summary.md | head -40
