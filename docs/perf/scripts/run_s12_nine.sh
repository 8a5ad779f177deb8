# Session 12, calls 9 and 11 (nvidia-h200, ONE GPU; call 11 as `RUN=s12_eleven bash ...`, after the pinned
# staging slots): after the numpy tile tables and the backward states built in the forward: the expert ops'
# one-GPU tests; the plan build's host time; the MoE layer at EP = 1 with a new routing every step
# (--routings 8, as in training) against Megatron's MoELayer, with its GPU gaps.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir ${RUN:-s12_nine} && mkdir -p $W/prof
step gpu_moe 150 python3 -m pytest -m gpu -q $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
step build 90 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_moe_build.py
step moe_layer 260 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192,16384 \
  --routing uniform,zipf --methods signal,off --routings 8 --reps 24 --profile $W/prof --out $W --name moe_layer_ep1_routings8
grep -E "passed|failed" $W/gpu_moe.out | tail -1; head -2 $W/build.out
grep -E "^\| " $W/moe_layer_ep1_routings8.md
for v in megatron signal off; do echo "== $v"; python3 $REPO/docs/perf/scripts/trace_gaps.py $W/prof/uniform.t8192_$v.json --top 5 | tee $W/gaps_$v.txt; done
rm -f $W/prof/*.json
