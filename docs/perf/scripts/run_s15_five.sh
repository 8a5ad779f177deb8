# Session 15, call 5 (nvidia-h200, ONE GPU): one _ExpertOp per op keeps the words, grid and watchdog record across
# routings (call 4: _ExpertState 221 us per new routing, ~90 of it the table's copy; expected ~100 us less before the
# dispatch GEMM's launch), the dispatch lowers only its plan's flags.
# - the one-GPU expert-op tests; the host probe at EP 1; the MoE layer at EP 1 in interleaved rounds.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s15_five
step gpu_tests 180 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -5
step host 120 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_expert_host.py
grep -E "forward|_dispatch_state|dispatch_plan|_ExpertState|SignaledGemm|host_table_to" $W/host.out
step moe_layer 240 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf,uniform --methods signal,off --reps 48 --rounds 6 --out $W --name moe_layer_ep1_rounds
grep -E "^\| " $W/moe_layer_ep1_rounds.md
