# The next 2-GPU session's FIRST call (nvidia-h200-x2), written in session 18 (one GPU only). Then run_s16_x2.sh,
# run_s15_b.sh, run_s15_e2e.sh, run_s15_moe.sh, run_s15_a.sh, in that order.
# - GPU tests at t = 2 over real NVLink and NCCL of session 18's two changes: the AllGather's one gathered buffer per
#   shape (GatherBuffer: test_ag_gemm_gpu.py, test_graphs_gpu.py) and the column-parallel dgrads' p2p sums left to
#   the norms' backward kernels (test_layers_gpu.py: the layer bitwise against the summed path, the MLP boundary);
#   both passed at t = 2 with two processes on one GPU (s18/gpu_tests.log);
# - issue 22's table, now with both: one TransformerLayer fwd + bwd under graphs, 8B and 70B at s 8192, Megatron's
#   layer, the no-communication counterfactual, ours off and ours signal (p2p transports), 8 interleaved rounds.
#   Session 13 (a6403d5): t/megatron 0.937 (8B), 0.985 (70B). Predicted from s18's kernel timings (one H100): the
#   dgrad sums ~53 us (8B) / ~82 us (70B) less per layer backward, the gathered buffer one 32 / 64 MB copy less per
#   AllGather before its first pull (hidden behind the local rows' GEMM at these shapes: ~0 on the layer);
# - the p2p plans' host time at t = 2 on two GPUs (s18 measured it with two ranks on one GPU).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s18_x2
step gpu_tests 240 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_layers_gpu.py $REPO/tests/gpu/test_ag_gemm_gpu.py \
  $REPO/tests/gpu/test_graphs_gpu.py -p no:cacheprovider
grep -E "^(FAILED|ERROR)|passed|failed" $W/gpu_tests.out | tail -12
step layer_graphs 270 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,nocomm,off,signal-p2p --reps 40 --rounds 8 --out $W --name layer_graphs_s18
grep -E "^\| |^- " $W/layer_graphs_s18.md | head -20
step probe_host 60 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 20
grep -E "^op=|memop" $W/probe_host.out
