# Session 16, call 11 (ONE GPU): call 10 again on zipf, the signal path's gaps attributed to the host (trace_gaps.py now
# follows driver-API launches too: the Triton kernels' C launcher calls cuLaunchKernelEx, which torch.profiler records
# as a cuda_driver event) with what the host did during the 4 largest.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_eleven
step moe_layer_prof 300 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 \
  --routings 8 --routing zipf --methods signal,off --reps 16 --rounds 2 --profile $W/prof --out $W \
  --name moe_layer_prof
grep -E "^\| " $W/moe_layer_prof.md
for r in zipf; do for v in signal; do
  echo "== $r $v"
  python3 $REPO/docs/perf/scripts/trace_gaps.py $W/prof/$r.t8192_$v.json --top 10 --host 4 > $W/gaps_${r}_$v.txt
  cat $W/gaps_${r}_$v.txt | cut -c1-160 | head -150
done; done
rm -f $W/prof/*.json
