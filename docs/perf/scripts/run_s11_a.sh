# Session 11, call 1 (nvidia-h200-x2): where the layer's time goes under CUDA graphs (issues 21, 22).
# bench layer --graphs on the 8B and 70B layers (Megatron, no-comm, ours off / signal / agp2p / both p2p) with a
# torch.profiler trace of each configuration's eager steps; bench ops --graphs --sweep for GEMM+RS (incl. p2p);
# the smoke recipe under full-iteration graphs with both transports on p2p against off. Each step is skipped
# once the call's time runs short (priority order).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s11_a && mkdir -p $W/prof
step layer 330 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,nocomm,off,signal,signal-agp2p,signal-p2p --reps 40 --rounds 5 --profile $W/prof --profile-steps 2 \
  --out $W --name layer_graphs
step ops_rs 120 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops rs --seq 8192 --sweep --reps 30 \
  --out $W --name ops_rs_graphs
for o in off signal; do
  step smoke-full-p2p-$o 60 env GRAPHS=full_iteration OVERLAP=$o TRANSPORT=p2p TRAIN_ITERS=40 OUT_DIR=$W/smoke-$o \
    bash $REPO/recipes/smoke.sh
done
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 2 $W/prof/*rank0.json.gz > $W/trace_summary.md 2>&1
python3 $REPO/docs/perf/scripts/summarize_runs.py $W/smoke-*/train.log > $W/smoke_summary.md 2>&1
cat $W/layer_graphs.md; cat $W/ops_rs_graphs.md | head -40; cat $W/smoke_summary.md; head -c 6000 $W/trace_summary.md
