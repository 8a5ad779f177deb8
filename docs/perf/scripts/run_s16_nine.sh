# Session 16, call 9 (ONE GPU): the expert ops take the counts on the GPU too (device_counts, which OverlapMoELayer
# passes): the dispatch's tile table is built from them, the counts' copy up (~100 us of host, call 3) gone from the
# path between the routing and the first expert GEMM. Tests: the one-GPU expert-op tests (the new one: the same bits
# with and without device counts, two copies fewer). The expert host probe (a2a_gemm with and without device counts),
# the MoE layer at EP 1 in rounds.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_nine
step gpu_tests 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -8
step probe_expert_host 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_expert_host.py
grep -E "^EP|SignaledGemm launch|host_table_to|dispatch table|_dispatch_state" $W/probe_expert_host.out
step moe_layer 240 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf,uniform --methods signal,off --reps 48 --rounds 6 --out $W --name moe_layer_ep1_rounds
grep -E "^\| " $W/moe_layer_ep1_rounds.md
