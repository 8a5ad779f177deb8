# The next session's second call (2 GPUs; ~7.5 min), written in session 26 (COMMIT=<sha> as a literal).
# 0. The mid layer over NVLink with the AllGather+GEMM over NCCL as sends and receives (4aa44be; s25: signal 1.004
#    of Megatron's layer with the broadcasts).
# 1. The expert ops with 2 comm SMs over NVLink (run_s27_1.sh measured them at the proxy): a new default must not
#    lose there (s20: signal 0.97 / 1.00 of Megatron's MoELayer, uniform / Zipf).
# 2. Issue 21: the smoke layer gains 1/0.902 at TP 2 under graphs (s26/layer_smoke_t2.md; ~1.045x predicted end to
#    end) while the recipe measured a tie (s20): one smoke step profiled off / signal under full_iteration graphs,
#    rank 0, summarised per kernel class and kernel (where does the layer's gain go?).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s27_2
export CUDA_VISIBLE_DEVICES=0,1
V=signal,signal.sm2,signal.g4.sm2,signal.g8.sm2,off
step mid_nvlink 90 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models mid \
  --seq 4096 --configs megatron,nocomm,signal,signal-p2p --reps 20 --rounds 4 --out $W --name layer_mid_nvlink
grep -E "^\| mid " $W/layer_mid_nvlink.md | cut -c1-200
step moe_nvlink_sm2 150 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --routing zipf,uniform --methods $V --reps 32 --rounds 8 --out $W --name moe_layer_nvlink_sm2
grep -E "^\| " $W/moe_layer_nvlink_sm2.md | cut -c1-500
for mode in off signal; do
  train smoke-$mode-prof 90 OVERLAP=$mode TRAIN_ITERS=24 -- $REPO/recipes/smoke.sh \
    --profile --use-pytorch-profiler --profile-step-start 22 --profile-step-end 23 --profile-ranks 0
  # megatron-core 0.19.2 (training.py) exports the profiled steps to <tensorboard dir>/../torch_profile/rank-<r>.json.gz
  trace=$W/smoke-$mode-prof/torch_profile/rank-0.json.gz
  python3 $REPO/docs/perf/scripts/trace_summary.py --steps 1 --top 30 $trace > $W/smoke_${mode}_step_summary.md 2>&1
  head -12 $W/smoke_${mode}_step_summary.md
  if (( $(stat -c %s $trace 2>/dev/null || echo 0) < 40000000 )); then mv $trace $W/smoke_${mode}_step.json.gz; fi
  rm -rf $W/smoke-$mode-prof/torch_profile
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/smoke-*/train.log | sed "s#$W/##" | tee $W/smoke.md
