# The next session's first call (2 GPUs; ~8 min), written in session 28: `COMMIT=<sha> bash docs/perf/scripts/run_s29_1.sh`
# (carry [".whl"]). Issue 21 / 22: `--overlap-tp-gather-in-place` (session 28: built and CPU-tested, never run on GPUs).
# 0. GPU tests: two layers gathering in place bit for bit the staged pair (signal and decompose, small and 8B shapes,
#    200 steps with a late peer; on one GPU too), the layer captured and replayed with it, and the existing fused-block
#    tests beside them (nothing else changed there).
# 1. One 8B layer fwd + bwd under graphs at s 8192, interleaved rounds: signal-p2p against signal-p2p-inplace (and the
#    decompose pair). Predicted: in place 0.3-0.8% faster per layer (the forward's two stage copies, 2 x ~22 us on the
#    critical path, and the backward's two re-gathers beside the dgrad GEMMs, of ~12.3 ms per layer).
# If the tests fail, stop there: run_s29_2.sh (end to end) needs them to pass.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=570
workdir s29_1
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step gpu_tests 330 python3 -m pytest -m gpu -v -rA --tb=short --durations=0 $REPO/tests/gpu/test_layers_gpu.py \
  $REPO/tests/gpu/test_p2p_one_gpu.py -k "gather_in_place or norms_write or in_place or p2p_sum_in_the_norm or \
  next_norm_and_fc2" -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/gpu_tests.out | grep -v "^\.\./" | cut -c1-200 | tail -20
step layer_l8b 200 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --configs megatron,nocomm,signal-p2p,signal-p2p-inplace,decompose-p2p,decompose-p2p-inplace --reps 24 --rounds 6 \
  --out $W --name layer_l8b_inplace
grep -E "^\| l8b " $W/layer_l8b_inplace.md | cut -c1-220
