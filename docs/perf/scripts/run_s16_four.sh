# Session 16, call 4 (ONE GPU): where the MoE layer's zipf gap goes (signal 0.93x against off 0.99x of Megatron's
# MoELayer at EP 1, call 3; the grouped GEMMs are within 4% of cuBLAS, s15). A profile of 3 steps per variant with
# Python stacks; per variant the GPU's busy time, its kernel table, and the idle gaps with what the host did.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_four
step moe_layer_prof 300 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 \
  --routings 8 --routing zipf --methods signal,off --reps 24 --rounds 2 --profile $W/prof --out $W --name moe_layer_prof
grep -E "^\| " $W/moe_layer_prof.md
for v in signal off megatron; do
  echo "== $v"; head -22 $W/prof/zipf.t8192_$v.txt | cut -c1-60,100-200
  python3 $REPO/docs/perf/scripts/trace_gaps.py $W/prof/zipf.t8192_$v.json --top 8 --host 3 > $W/gaps_$v.txt
  head -60 $W/gaps_$v.txt
done
rm -f $W/prof/*.json
