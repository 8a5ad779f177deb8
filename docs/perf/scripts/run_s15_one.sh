# Session 15, call 1 (nvidia-h200, ONE GPU): the expert plans built with numpy over the [ep, L] segments (no Python
# loop per tile or piece, no torch.tensor of nested lists; the table's rows and starts in one copy), against
# session 14's call 7 (the GPU idle 1.0-1.4 ms per step before the tile table's copy; signal 0.94x Megatron at EP 1).
# - the one-GPU expert-op tests (the grouped signaled GEMM from the new plans vs per-expert cuBLAS, fwd + bwd);
# - the host time of a new routing's expert call, piece by piece (probe_expert_host.py);
# - the MoE layer at EP 1, profiled with Python stacks: what the host does during the largest gaps.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s15_one
step gpu_tests 150 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed" $W/gpu_tests.out | tail -3
step host 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_expert_host.py
cat $W/host.out | grep -v Warning | tail -40
step moe_prof 220 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf --methods signal,off --profile $W/prof --out $W --name moe_layer_ep1_prof
grep -E "^\| " $W/moe_layer_ep1_prof.md
for v in megatron signal; do
  f=$(ls $W/prof/zipf*_$v.json 2>/dev/null | head -1); [[ -n $f ]] || continue
  echo "== $v"; python3 $REPO/docs/perf/scripts/trace_gaps.py $f --min-us 30 --top 6 --host 2 | head -60
done 2>&1 | tee $W/gaps.txt
rm -f $W/prof/*.json
