# Session 32's fourth call (4 GPUs, `nvidia-h200-x4`; ~5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s32_4.sh`
# (carry [".whl"]). The token split's next questions, with our own ops (issue 22; docs/fused_block.md, Token split):
# 1. AgGemm.start()/finish(), the split's building block: two halves in flight, eager and 50 graph replays bit for
#    bit the plans' own calls, a late peer (test_split_allgather_gemm_replays_bitwise_equal_to_its_call), at t = 4.
# 2. probe_token_split_ours.py at t = 4 and t = 2: the 8B attention block for two sequences through the signaled ops,
#    sequential halves against staggered (both halves' pulls issued first). Predicted at t = 4 under a graph: the
#    staggered order hides half B's qkv pulls (~0.2 ms of copy-engine time) beside half A's attention, minus what
#    the signaled GEMM already hid of them: 0.05-0.1 ms of a ~1.5 ms block (3-6%); at t = 2 less (the pulls are
#    shorter than the GEMM they feed).
# 3. One 8B layer under graphs at t = 4 (signal-p2p in place against nocomm and Megatron), profiled: where the
#    0.48 ms over the counterfactual that session 30 measured goes (one replay per configuration, rank 0's trace).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-330}
workdir s32_4
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step split_test_t4 100 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_graphs_gpu.py -k "split"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/split_test_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -3
step ours_t4 70 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_token_split_ours.py
step ours_t2 60 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_token_split_ours.py
grep -h -E "^(t = |eager|graph|attention:)|Error" $W/ours_t*.out | head -12
step layer_t4 130 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --configs megatron,nocomm,signal-p2p-inplace --reps 16 --rounds 2 --out $W --name layer_t4_prof --profile $W/prof
grep -E "^\| l8b " $W/layer_t4_prof.md | cut -c1-200
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 $W/prof/*_graph_rank0.json.gz > $W/layer_t4_prof_trace.txt 2>&1
head -80 $W/layer_t4_prof_trace.txt
