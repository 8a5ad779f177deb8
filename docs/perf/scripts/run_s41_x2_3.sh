# Session 41, call 3 (2 GPUs, `nvidia-h200-x2`; ~9 min): `COMMIT=<sha> bash docs/perf/scripts/run_s41_x2_3.sh`
# (carry [".whl"]). Issue 20: ag_gemm's replays cover a claimed region too (OwnGather, the fused block's in-place
# gather); gemm_ar p2p copies its own region on the caller's stream, beside the pulls.
# 1. GPU tests: the replays (OwnGather's with them), gemm_ar, the layers through the replayed ops (in-place gathers,
#    token split, the norm's slot sums), every op captured by the user (their capture path, unchanged), the p2p ops on
#    one GPU, the soak;
# 2. `bench ops` for gemm_ar under graphs: predicted p2p 0.370 -> ~0.35 ms at l8b.proj s 8192 (the own copy's ~20 us
#    beside the pull instead of after it).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s41_x2_3
tests replay 150 $REPO/tests/gpu/test_replay_gpu.py
tests gemm_ar 90 $REPO/tests/gpu/test_gemm_rs_gpu.py -k "gemm_ar or async_op"
step ar_graphs 60 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops ar --shapes l8b.proj,l70b.proj \
  --ar-seq 8192 --graphs --reps 20 --out $W --name ar_graphs_t2
grep -E "^\|" $W/ar_graphs_t2.md | cut -c1-600
grep -h '"variants"' -A3 $W/ar_graphs_t2.json | head -12
tests graphs 80 $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays or split_allgather"
tests layers 200 $REPO/tests/gpu/test_layers_gpu.py -k "linears_match_megatron_p2p or p2p_sum_in_the_norm or norms_write_into or gather_in_place_at_the_8b or token_split_matches"
tests one_gpu 90 $REPO/tests/gpu/test_p2p_one_gpu.py -k "test_p2p_transports_at_t2"
tests soak 60 $REPO/tests/gpu/test_soak_gpu.py
