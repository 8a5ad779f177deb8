# Session 14, call 6 (nvidia-h200, ONE GPU), issue 25's NVLink gap: at EP 1 (no all-to-all) with a new routing every
# step our MoE layer is 0.96-0.98x Megatron's MoELayer with signal and 0.97-0.99x with off (call 5, session 12).
# Where do the GPU's idle stretches come from? bench moe_layer --profile (3 steps per variant) and
# scripts/trace_gaps.py on each trace: the gaps, and the host op that ended each.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s14_six
step moe_prof 240 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf --methods signal,off --profile $W/prof --out $W --name moe_layer_ep1_prof
grep -E "^\| " $W/moe_layer_ep1_prof.md
for v in megatron off signal; do
  f=$(ls $W/prof/*_$v.json 2>/dev/null | head -1); [[ -n $f ]] || continue
  echo "== $v"; python3 $REPO/docs/perf/scripts/trace_gaps.py $f --min-us 30 --top 12 | head -40
done 2>&1 | tee $W/gaps.txt
for v in megatron off signal; do echo "== $v"; head -30 $(ls $W/prof/*_$v.txt | head -1); done > $W/kernels.txt 2>&1
rm -f $W/prof/*.json
