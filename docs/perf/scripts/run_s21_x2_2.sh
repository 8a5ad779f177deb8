# The next 2-GPU session's SECOND call (~9.5 min; after run_s21_x2_1.sh, same machine), written in session 20.
# - Where the 8B training step's time goes (issue 21): session 20's 8-layer run gained 11 ms per iteration where the
#   layer benchmark predicts 21, and ~356 of its 750 ms are outside the transformer layers. One profiled iteration
#   (Megatron's --profile --use-pytorch-profiler, rank 0) of off and of signal, summarised by trace_summary.py;
# - issue 22's fused block on vs off end to end: signal with --no-overlap-tp-fused-norms (Megatron's bda then the
#   norm, every reduce-scatter summed first) next to the profiled signal run's time;
# - the layer under graphs with the per-op mix (mixed-p2p: the signaled GEMM behind the AllGather, cuBLAS's regions
#   for the ReduceScatter: each the faster on most s 8192 shapes in session 20) and the tuner's pick (auto, timed
#   under graph replays since session 19), 8B and 70B; then the smoke's layer (s 2048, micro-batch 2), where the
#   GEMMs are shorter than their collectives: how much communication is there to hide at all (nocomm);
# - the copy engines' pull bandwidth over 1-8 streams (probe_ce_pulls.py).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s21_x2_2
PROFILE=(--profile --use-pytorch-profiler --profile-step-start 20 --profile-step-end 21 --profile-ranks 0)
for mode in off signal; do
  train l8b8-$mode-prof 110 GRAPHS=local OVERLAP=$mode TRAIN_ITERS=22 GBS=4 -- $REPO/recipes/llama3-8b.sh \
    --num-layers 8 "${PROFILE[@]}"
  # megatron-core 0.19.2 (training.py) exports the profiled steps to <tensorboard dir>/../torch_profile/rank-<r>.json.gz
  mv $W/l8b8-$mode-prof/torch_profile/rank-0.json.gz $W/l8b8_${mode}_step.json.gz
done
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 1 --top 24 $W/l8b8_*_step.json.gz | tee $W/l8b8_step_summary.md
train l8b8-signal-unfused 110 GRAPHS=local OVERLAP=signal TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh \
  --num-layers 8 --no-overlap-tp-fused-norms
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b8-*/train.log | tee $W/l8b8.md
step layer_mix 100 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,nocomm,off,signal-p2p,decompose-p2p,mixed-p2p --reps 40 --rounds 8 --out $W --name layer_mix
grep -E "^\| |^- " $W/layer_mix.md | cut -d'|' -f1-8 | head -20
step layer_smoke 90 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models smoke --seq 2048 \
  --micro-batch 2 --configs megatron,nocomm,off,signal-p2p,decompose-p2p,mixed-p2p --reps 60 --rounds 8 --out $W \
  --name layer_smoke
grep -E "^\| |^- " $W/layer_smoke.md | cut -d'|' -f1-8 | head -12
# the copy engines' pull bandwidth with a pull split over 1-8 streams (probe_ce_pulls.py): whether the p2p AllGather's
# pulls, which outlast the local rows' GEMM at the 8B qkv shape, can arrive sooner
step ce_pulls 60 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_ce_pulls.py
grep -E "^pull|checked" $W/ce_pulls.out
# last: the tuner's pick (its first call of each shape measures the candidates, so its time is not known beforehand)
step layer_auto 120 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models l8b,l70b \
  --configs megatron,signal-p2p,auto --reps 40 --rounds 8 --out $W --name layer_auto
grep -E "^\| |^- " $W/layer_auto.md | cut -d'|' -f1-8 | head -12
