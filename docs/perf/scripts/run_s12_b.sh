# Next session, call 2 (nvidia-h200-x2), written at the end of session 11: the layer under graphs with the
# p2p sum in the norm kernel, profiled as replays (bench layer --graphs --profile: what was timed, no launch
# gaps), more interleaved rounds than session 11 (its per-round ranges were 5-15% wide); then the faults
# script under full-iteration graphs (the exit fix), both checkpoint formats.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s12_b && mkdir -p $W/prof
step layer 260 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,nocomm,off,signal-agp2p,signal-p2p --reps 60 --rounds 12 --profile $W/prof --out $W --name layer_graphs
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 --top 24 $W/prof/*_graph_rank0.json.gz > $W/trace_summary.md 2>&1
cd $REPO
step faults 290 env COMMIT=${COMMIT:-unknown} OUT=$W/faults WORK=/tmp/s12 SKIP_INSTALL=1 GRAPHS=full_iteration \
  bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
grep -E "^\| l|^- l" $W/layer_graphs.md; grep -A1 "^## " $W/trace_summary.md; tail -20 $W/faults/summary.md 2>/dev/null
