# Session 32's sixth call (4 GPUs, `nvidia-h200-x4`; the session's last ~4.5 min of device time): `COMMIT=<sha> bash
# docs/perf/scripts/run_s32_6.sh` (carry [".whl"]). --overlap-tp-defer-wgrad (layers.WgradHandoff): linear_fc1's
# wgrad GEMM runs inside linear_proj's backward, between its dgrad AllGather's start and its GEMM. Call 4's profile
# (docs/perf/s32/README.md) showed proj's dgrad AllGather+GEMM at 0.285 ms against cuBLAS's 0.087 at t = 4: its pulls
# had nothing beside them. Predicted: that op -> ~0.11 ms, the layer -0.15 to -0.2 ms (t/megatron 0.93 -> ~0.905).
# 1. The GPU test: the deferred pair bit for bit the staged one (8B layers at s 8192; the small pair with a late
#    peer), signal only (the recipes' TP >= 4 mode), at t = 4.
# 2. One 8B layer under graphs at t = 4: signal-p2p in place with and without the deferral, against nocomm and
#    Megatron, profiled (one replay each).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-235}
workdir s32_6
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step layer_t4 110 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --configs megatron,nocomm,signal-p2p-inplace,signal-p2p-inplace-dw --reps 16 --rounds 2 --out $W \
  --name layer_t4_dw --profile $W/prof
grep -E "^\| l8b " $W/layer_t4_dw.md | cut -c1-200
step dw_test_t4 95 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "deferred_fc1_wgrad and signal"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/dw_test_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -3
python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 $W/prof/*inplace*_graph_rank0.json.gz > $W/layer_t4_dw_trace.txt 2>&1
grep -E "^## |per step" $W/layer_t4_dw_trace.txt
