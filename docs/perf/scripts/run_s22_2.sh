# The next session's SECOND call (~9 min; after run_s22_1.sh, same machine), written in session 20, revised in 21
# (the copy-engine probe moved to run_s22_1.sh). With 4 GPUs, every run here uses GPUs 0-1.
# - Where our layer's GPU time goes (issue 22): session 20's layer under graphs put ours (signal-p2p) 0.32 ms of GPU
#   time above Megatron's no-communication counterfactual at 8B, and our own layer with the overlap off is 0.18 ms
#   below Megatron's (the fused norms), so ~0.5 ms per layer step are the overlap's own cost. The layer timed and
#   profiled (one graph replay per configuration, Chrome traces, trace_summary.py), with the per-op mix (mixed-p2p:
#   the signaled GEMM behind the AllGather, cuBLAS's regions for the ReduceScatter: each the faster on most s 8192
#   shapes in session 20);
# - where the 8B training step's time goes (issue 21): ~356 of its 750 ms are outside the transformer layers; one
#   profiled iteration of signal (Megatron's --profile --use-pytorch-profiler, rank 0, iteration 22; the logged
#   intervals up to 20 stay clean);
# - issue 22's fused block on vs off end to end: signal with --no-overlap-tp-fused-norms (Megatron's bda then the
#   norm, every reduce-scatter summed first) against the profiled run's clean intervals;
# - copy_lanes' GPU tests, then the layer under graphs with signal-p2p against signal-p2p-lanes2.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s22_2
export CUDA_VISIBLE_DEVICES=0,1
step layer_prof 150 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,nocomm,off,signal-p2p,decompose-p2p,mixed-p2p --reps 40 --rounds 8 --profile $W/prof \
  --out $W --name layer_mix
grep -E "^\| |^- " $W/layer_mix.md | cut -d'|' -f1-10 | head -20
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 --top 16 $W/prof/l8b_*_graph_rank0.json.gz \
  > $W/layer_trace_summary.md 2>&1; grep -E "^## |^per step|^GPU time" $W/layer_trace_summary.md
rm -f $W/prof/*rank1*   # rank 0's traces come back; rank 1's would only double the size
train l8b8-signal-prof 110 GRAPHS=local OVERLAP=signal TRAIN_ITERS=24 GBS=4 -- $REPO/recipes/llama3-8b.sh \
  --num-layers 8 --profile --use-pytorch-profiler --profile-step-start 22 --profile-step-end 23 --profile-ranks 0
# megatron-core 0.19.2 (training.py) exports the profiled steps to <tensorboard dir>/../torch_profile/rank-<r>.json.gz
mv $W/l8b8-signal-prof/torch_profile/rank-0.json.gz $W/l8b8_signal_step.json.gz
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 1 --top 24 $W/l8b8_signal_step.json.gz \
  | tee $W/l8b8_step_summary.md | head -30
train l8b8-signal-unfused 110 GRAPHS=local OVERLAP=signal TRAIN_ITERS=24 GBS=4 -- $REPO/recipes/llama3-8b.sh \
  --num-layers 8 --no-overlap-tp-fused-norms
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b8-*/train.log | tee $W/l8b8.md
step lanes_tests 75 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_ag_gemm_gpu.py \
  $REPO/tests/gpu/test_graphs_gpu.py -k "s8192 or late_peer or every_op_replays" -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/lanes_tests.out | grep -v "^\.\./" | tail -6
step layer_lanes 70 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,signal-p2p,signal-p2p-lanes2 --reps 40 --rounds 8 --out $W --name layer_lanes
grep -E "^\| |^- " $W/layer_lanes.md | cut -d'|' -f1-10 | head -10
