# Session 15, call 3 (nvidia-h200, ONE GPU): a one-rank EP group moves nothing (no all_to_all copy in `off`, no
# local-block copy in `signal`), against call 2. Expected at EP 1, 8192 tokens, top-2, hidden 4096 (x: 128 MB):
# off ~4 copies of 128 MB (~75 us each) and 4 NCCL launches less per step (~0.4-0.6 ms of 29 ms), signal 2 copies
# less (~0.15 ms).
# - the one-GPU expert-op tests; the MoE layer at EP 1 (its outputs checked against Megatron's by the bench).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s15_three
step gpu_tests 180 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/gpu_tests.out | tail -5
step moe_layer 200 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf,uniform --methods signal,off --out $W --name moe_layer_ep1
grep -E "^\| " $W/moe_layer_ep1.md
