# Session 12, call 6 (nvidia-h200, ONE GPU), issue 25 item 1: where the MoE layer's GPU waits for the host, EP = 1,
# after the permute was queued ahead of the counts' wait: bench moe_layer --profile (8192 tokens), then
# trace_gaps.py on each variant's trace.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s12_six && mkdir -p $W/prof
step moe_layer 240 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192,16384 \
  --routing uniform,zipf --methods signal,off --reps 20 --profile $W/prof --out $W --name moe_layer_ep1
grep -E "^\| " $W/moe_layer_ep1.md
for v in megatron off signal; do echo "== $v"; python3 $REPO/docs/perf/scripts/trace_gaps.py $W/prof/uniform.t8192_$v.json --top 10 | tee $W/gaps_$v.txt; done
rm -f $W/prof/*.json
