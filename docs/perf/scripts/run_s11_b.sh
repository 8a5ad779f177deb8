# Session 11, call 2 (nvidia-h200-x2): the p2p GEMM+ReduceScatter's sum as a Triton kernel, deferred to
# Pending.wait() (the wgrad hides the peer wait). GPU tests of gemm_rs and graphs, then bench layer --graphs
# (8B, 70B) with profiles, then bench ops --graphs for GEMM+RS. Steps skipped once time runs short.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s11_b && mkdir -p $W/prof
step gpu_tests 200 python3 -m pytest -m gpu -x -q -rA $REPO/tests/gpu/test_gemm_rs_gpu.py $REPO/tests/gpu/test_graphs_gpu.py -k "s8192 or odd or bias or graph or replay or capture" -p no:cacheprovider
step layer 250 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,nocomm,off,signal-agp2p,signal-p2p --reps 40 --rounds 5 --profile $W/prof --profile-steps 2 \
  --out $W --name layer_graphs
step ops_rs 110 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops rs --seq 8192 --sweep --reps 30 \
  --out $W --name ops_rs_graphs
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 2 --top 24 $W/prof/*rank0.json.gz > $W/trace_summary.md 2>&1
grep -E "^\| l|^- l" $W/layer_graphs.md; grep "^| rs" $W/ops_rs_graphs.md; grep -A1 "^## " $W/trace_summary.md
