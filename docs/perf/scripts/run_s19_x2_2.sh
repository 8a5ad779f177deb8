# The next 2-GPU session's SECOND call (after run_s19_x2_1.sh; ~9.5 min), written in session 19 (no GPU).
# - GPU tests at t = 2 over real NVLink of everything the one-GPU sessions 16-19 changed on the dense path (those ran
#   with two processes on one GPU over CUDA IPC, never on two GPUs): test_layers_gpu.py (our linears against
#   Megatron's on both p2p GEMMs, the deferred slot sums in the norms' kernels forward and backward, the MLP
#   boundary; decompose-p2p new in session 19);
# - issue 22's table under graphs: one TransformerLayer fwd + bwd, 8B and 70B at s 8192, Megatron's layer, the
#   no-communication counterfactual, ours off, signal-p2p (the default) and decompose-p2p (cuBLAS over the same
#   transports), 8 interleaved rounds. Session 13 (a6403d5): signal-p2p / megatron 0.937 (8B), 0.985 (70B); nocomm
#   0.938 / 0.971. Predicted for session 19's code: signal-p2p ~50-80 us less per 8B layer (the dgrad sums in the
#   norms, s18), decompose-p2p at or below signal-p2p where the signaled GEMM trails cuBLAS (0.978 / 0.989 on the 8B
#   forward GEMMs).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s19_x2_2
step layer_tests 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_layers_gpu.py -p no:cacheprovider
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/layer_tests.out | tail -14
step layer_graphs 330 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,nocomm,off,signal-p2p,decompose-p2p --reps 40 --rounds 8 --out $W --name layer_graphs_s19
grep -E "^\| |^- " $W/layer_graphs_s19.md | head -24
