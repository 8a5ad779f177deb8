# Next session, call 1 (nvidia-h200-x2), written at the end of session 11 for what it could not run:
# - GPU tests pending a run: linear_proj's p2p sum inside the fused norm kernel (bitwise the summed path), the MLP
#   boundary (session 12: fc2's p2p sum, the bda and the next layer's input norm in one kernel), the
#   MoE layer captured with static sizes, the graph tests (deadline waits);
# - the full-iteration exit fix (launch/pretrain.py frees Megatron's graphs): smoke off / signal must now exit
#   by themselves (each run watched: 30 s after "after training is done" its workers get SIGABRT);
# - GEMM+RS and AllGather+GEMM ops in ONE run under graphs with host time (issue 21's median %ideal from one
#   run; issue 20's host us through the p2p plans). run_s12_b.sh: the layer and the faults.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s12_a
step gpu_layer 150 python3 -m pytest -m gpu -x -q -rA $REPO/tests/gpu/test_layers_gpu.py $REPO/tests/gpu/test_gemm_rs_gpu.py \
  $REPO/tests/gpu/test_moe_layer_gpu.py -k "p2p_sum or mlp_boundary or captured or bias or s8192" -p no:cacheprovider
step gpu_graphs 100 python3 -m pytest -m gpu -x -q -rA $REPO/tests/gpu/test_graphs_gpu.py -p no:cacheprovider
train smoke-off 75 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
train smoke-signal 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
step ops 150 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --host --ops rs,ag --seq 8192 \
  --ag-seq 8192 --reps 30 --out $W --name ops_t2_graphs
python3 $REPO/docs/perf/scripts/summarize_runs.py $W/smoke-*/train.log | tee $W/smoke_summary.md
grep -E "^\| (rs|ag)" $W/ops_t2_graphs.md
