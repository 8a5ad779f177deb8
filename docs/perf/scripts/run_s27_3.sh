# Session 27's third call (2 GPUs; ~9.5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s27_3.sh`.
# 0. GPU tests of this session's two changes: the AllGather+GEMM over NCCL as one in-place AllGather per chunk into a
#    chunk-major buffer (run_s27_1.sh measured the sends and receives of 4aa44be slower at the proxy: 1.056x of
#    Megatron's mid layer against the broadcasts' 0.996x), and the signaled GEMM's routing integers unspecialized
#    (a Zipf routing's first step compiled one variant in every expert-op config).
# 1. The mid layer at the proxy: predicted signal ~0.94x of Megatron's (each chunk's transfer now as fast as
#    Megatron's AllGather of its rows: the forward AllGathers' ~1 ms of chunk broadcasts per step partly hidden),
#    the broadcasts' tree (.ab/old, carry [".whl", ".ab"]) beside it; then over NVLink (s27_2: signal 1.016x).
# 2. The MoE layer's first pass over the proxy's routings: predicted no compile in it (s27_1: signaled_gemm_kernel x1
#    per variant on Zipf, first pass 542 ms per step against 48 warm).
# 3. Issue 21: the smoke recipe off / signal, unprofiled, with the recipe's graphs (local), twice each, alternating.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s27_3
export CUDA_VISIBLE_DEVICES=0,1
step gpu_tests 150 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_ag_gemm_gpu.py \
  $REPO/tests/gpu/test_graphs_gpu.py $REPO/tests/gpu/test_direct_launch_gpu.py $REPO/tests/gpu/test_moe_ops_gpu.py \
  -k "s8192 or odd or late_peer or back_to_back or every_op_replays or specialization or routings or expert_ops" \
  -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/gpu_tests.out | grep -v "^\.\./" | cut -c1-200 | tail -30
step mid_proxy 110 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models mid \
  --seq 4096 --configs megatron,nocomm,signal,decompose --reps 20 --rounds 4 --out $W --name layer_mid_proxy
grep -E "^\| mid " $W/layer_mid_proxy.md | cut -c1-200
if [[ -d $REPO/.ab/old ]]; then
  rm -rf /tmp/old && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old $REPO/.ab/old 2>&1 | tail -1
  step mid_proxy_old 100 env PYTHONPATH=/tmp/old:/tmp/site NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 \
    -m overlap_tp.bench layer --graphs --models mid --seq 4096 --configs megatron,signal --reps 20 --rounds 4 \
    --out $W --name layer_mid_proxy_old
  grep -E "^\| mid " $W/layer_mid_proxy_old.md | cut -c1-200
fi
step mid_nvlink 80 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models mid \
  --seq 4096 --configs megatron,signal,signal-p2p --reps 20 --rounds 4 --out $W --name layer_mid_nvlink
grep -E "^\| mid " $W/layer_mid_nvlink.md | cut -c1-200
step moe_first 110 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --routing zipf,uniform --methods signal,off --reps 16 --rounds 4 --out $W --name moe_layer_proxy_first
grep -E "^\| " $W/moe_layer_proxy_first.md | cut -c1-400
for i in 1 2; do
  for mode in off signal; do
    train smoke-$mode-$i 75 OVERLAP=$mode TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | tee $W/smoke.md
