# Session 16, call 10 (ONE GPU): why signal loses ~1.9 ms per MoE layer step on zipf routing but ~0.5 ms on uniform
# at EP 1 (calls 3 and 9: 31.0 vs 29.1 ms zipf, 30.1 vs 29.6 uniform, off vs signal), with equal GPU work (call 4,
# zipf). A profile of both routings, signal and off: GPU busy per step and the largest idle gaps.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_ten
step moe_layer_prof 300 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 \
  --routings 8 --routing zipf,uniform --methods signal,off --reps 24 --rounds 2 --profile $W/prof --out $W \
  --name moe_layer_prof
grep -E "^\| " $W/moe_layer_prof.md
for r in zipf uniform; do for v in signal off; do
  echo "== $r $v"
  python3 $REPO/docs/perf/scripts/trace_gaps.py $W/prof/$r.t8192_$v.json --top 10 > $W/gaps_${r}_$v.txt
  head -24 $W/gaps_${r}_$v.txt
done; done
rm -f $W/prof/*.json
