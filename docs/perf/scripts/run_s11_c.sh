# Session 11, call 3 (nvidia-h200-x2): GEMM+RS ops under graphs (the p2p order change), then reliability
# (issue 24): the 10,000-call soak, training under faults with resume (run_s10_faults.sh), the layer GPU tests
# and the MoE layer's 200 steps. Steps skipped once time runs short (priority order).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s11_c
step ops_rs 90 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops rs --seq 8192 --sweep --reps 30 \
  --out $W --name ops_rs_graphs
step soak 150 python3 -m pytest -m gpu -x -q -rA -s $REPO/tests/gpu/test_soak_gpu.py -p no:cacheprovider
cd $REPO
step faults 250 env COMMIT=${COMMIT:-unknown} OUT=$W/faults WORK=/tmp/s10 SKIP_INSTALL=1 bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
step moe200 90 python3 -m pytest -m gpu -x -q -rA $REPO/tests/gpu/test_moe_layer_gpu.py -k 200 -p no:cacheprovider
step layers 150 python3 -m pytest -m gpu -x -q -rA $REPO/tests/gpu/test_layers_gpu.py -p no:cacheprovider
grep "^| rs" $W/ops_rs_graphs.md; cat $W/faults/summary.md 2>/dev/null | tail -25
