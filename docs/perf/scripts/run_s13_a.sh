# Session 13, call 1 (nvidia-h200-x2): why two identical TP-1 layer runs differed in session 12 (.diag/diag_det.py:
# each SDPA backend's backward twice, the layer twice under each remedy), then session 12's pending GPU tests (the
# p2p sums inside the fused norm kernel, the MLP boundary, the MoE layer captured, the graph deadline tests) and
# the ops under graphs with host time (issue 20: host us through the p2p plans; issue 21: median % of ideal).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s13_a
step diag 90 env REPO=$REPO CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_determinism.py
grep -E "^(sdpa|layer)" $W/diag.out
step gpu_layer 170 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_layers_gpu.py $REPO/tests/gpu/test_gemm_rs_gpu.py \
  $REPO/tests/gpu/test_moe_layer_gpu.py -k "p2p_sum or mlp_boundary or captured or bias or s8192" -p no:cacheprovider
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_layer.out | tail -20
step gpu_graphs 100 python3 -m pytest -m gpu -x -q -rA $REPO/tests/gpu/test_graphs_gpu.py -p no:cacheprovider
step ops 150 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --host --ops rs,ag --seq 8192 \
  --ag-seq 8192 --reps 30 --out $W --name ops_t2_graphs
grep -E "^\| (rs|ag)|median" $W/ops_t2_graphs.md
