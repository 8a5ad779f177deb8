# Session 14, call 3 (nvidia-h200, ONE GPU). Call 2 (graph replays) found the signaled GEMM at the smoke recipe's
# backward GEMMs 0.67x (proj dgrad, 64 default tiles on 132 SMs) and 0.81x (fc2 dgrad) of cuBLAS where 128x128x64/4/4
# ran 1.04x / 1.00x; the plans now pick that tile by shape (OverlapConfig.tile_by_shape). Here:
# - the rule's GPU test (plans at t = 1 take the narrow tile where the rule says, results exact);
# - bench gemm at the smoke shapes, default vs narrow tile, the rule's pick marked;
# - the smoke layer at TP 1 again (megatron, off, signal-p2p) with the rule, and a profile of one graph replay per
#   configuration: where signal-p2p's +4% over Megatron's layer (call 2) goes, with no communication at all.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s14_three
step gpu_rule 120 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_tile_rule_gpu.py -p no:cacheprovider
step gemm_smoke 120 python3 -m overlap_tp.bench gemm --layers smoke --seq 4096 --comm-sms 0 --configs 128x128x64/4/4 \
  --rounds 7 --out $W --name gemm_smoke_rule
grep -E "cuBLAS/ours median" $W/gemm_smoke.out
step layer_tp1 200 torchrun --nproc-per-node 1 -m overlap_tp.bench layer --graphs --models smoke --seq 2048 \
  --micro-batch 2 --configs megatron,off,signal-p2p --reps 60 --rounds 6 --profile $W/prof --out $W --name layer_tp1_smoke_rule
grep -E "^\| smoke|Error" $W/layer_tp1_smoke_rule.md $W/layer_tp1.out | head
for f in $W/prof/*graph_rank0.json.gz; do python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 $f | head -40; done \
  > $W/trace_summary.txt 2>&1; head -150 $W/trace_summary.txt
