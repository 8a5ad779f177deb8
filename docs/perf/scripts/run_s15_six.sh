# Session 15, call 6 (nvidia-h200, ONE GPU): the dispatch's row-tile table built on the GPU from the counts
# (kernels/expert_row_tiles.py: one small copy and one launch) instead of numpy on the host and a table copy, and the
# plans' tile counts without their tables. Call 5: a2a_gemm's forward 1.06 ms from the call to the GEMM's launch;
# expected ~0.25 ms less (dispatch_plan ~285 -> ~60 us, the table's way to the GPU ~150 -> ~100 us).
# - the one-GPU expert-op tests (with the device table against the host's at EP 1 to 8); the host probe at EP 1;
#   the MoE layer at EP 1 in interleaved rounds.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s15_six
step gpu_tests 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -5
step host 120 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_expert_host.py
grep -E "forward|_dispatch_state|dispatch_plan|_ExpertState|SignaledGemm|host_table_to|on the GPU" $W/host.out
step moe_layer 240 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf,uniform --methods signal,off --reps 48 --rounds 6 --out $W --name moe_layer_ep1_rounds
grep -E "^\| " $W/moe_layer_ep1_rounds.md
