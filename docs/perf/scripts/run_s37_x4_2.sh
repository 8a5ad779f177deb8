# Session 37 (4 GPUs, `nvidia-h200-x4`; ~9 min): `COMMIT=<sha> bash docs/perf/scripts/run_s37_x4_2.sh` (carry
# [".whl"]). The token split (issue 22's second route, built this session: `--overlap-tp-token-split`), its first run
# on GPUs. Predicted at t = 4 for one 8B layer on a micro-batch of 2 (two halves of one sequence each, the same GEMM
# sizes as today's micro-batch of 1): half A's proj and fc2 partials pushed beside half B's attention / MLP and half
# B's fc1 / qkv dgrad partials beside half A's backward, i.e. ~4 of the ~8 ReduceScatter edges of ~50-100 us each per
# two sequences: ~0.2-0.3 ms of ~12 ms, 1.035 -> ~1.015 of the counterfactual; the split's own cost: a chunk copy and
# a cat per layer (~20 us each at t = 4), more launches (none under graphs).
# 1. GPU tests at t = 4: the split against the whole micro-batch (signal / decompose on p2p, small), the 8B shape with
#    a late peer; the in-place tests (the gathered buffers are now kept per plan instance);
# 2. one 8B and one 70B layer at t = 4, micro-batch 2, graphs: signal-p2p-inplace-dw against its -split, 3 rounds;
# 3. the same 8B layer at t = 2 (GPUs 0-1).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s37_x4_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step split_tests_t4 170 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "token_split or gathered_buffers"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/split_tests_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -6
step layer_t4 230 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b,l70b --seq 8192 \
  --micro-batch 2 --configs megatron,nocomm,signal-p2p-inplace-dw,signal-p2p-inplace-dw-split --reps 12 --rounds 3 \
  --out $W --name layer_t4_split
grep -E "^\| l(8|70)b " $W/layer_t4_split.md | cut -c1-200
grep -E "Error|error" $W/layer_t4.out | head -5
CUDA_VISIBLE_DEVICES=0,1 step layer_t2 100 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b \
  --seq 8192 --micro-batch 2 --configs megatron,nocomm,signal-p2p-inplace,signal-p2p-inplace-split --reps 12 \
  --rounds 3 --out $W --name layer_t2_split
grep -E "^\| l8b " $W/layer_t2_split.md | cut -c1-200
