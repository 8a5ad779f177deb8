# Session 14, call 7 (nvidia-h200, ONE GPU): the grouped expert GEMMs' tiles as row tiles (the kernel expands them:
# ROW_TILES), against call 6, where the GPU waited ~1 ms per step before the tile table's copy with a new routing
# every step (signal 0.98x Megatron's MoELayer at EP 1, GPU busy equal). Expected: the host's table 0.5-0.6 ms
# less per plan, the copy 0.8 MB -> ~10 KB; the gap before the first expert GEMM about halved.
# - the one-GPU expert-op tests (compiled ROW_TILES: grouped signaled GEMM vs per-expert cuBLAS, fwd + bwd);
# - the grouped GEMM alone (bench moe at EP 1: the in-kernel expansion must cost the GEMM nothing);
# - the MoE layer at EP 1, profiled, and the gaps (as call 6).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s14_seven
step gpu_tests 150 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed" $W/gpu_tests.out | tail -3
step moe_ops 150 torchrun --nproc-per-node 1 -m overlap_tp.bench moe --experts 4 --tokens 8192 --reps 20 \
  --out $W --name moe_ep1_gemm
grep -E "^\| " $W/moe_ep1_gemm.md | head -8
step moe_prof 200 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf,uniform --methods signal,off --profile $W/prof --out $W --name moe_layer_ep1_prof
grep -E "^\| " $W/moe_layer_ep1_prof.md
for v in megatron off signal; do
  f=$(ls $W/prof/zipf*_$v.json 2>/dev/null | head -1); [[ -n $f ]] || continue
  echo "== $v"; python3 $REPO/docs/perf/scripts/trace_gaps.py $f --min-us 30 --top 8 | head -24
done 2>&1 | tee $W/gaps.txt
rm -f $W/prof/*.json
