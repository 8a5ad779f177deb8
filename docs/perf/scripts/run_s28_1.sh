# The next session's first call (2 GPUs; ~9.5 min), written in session 27: `COMMIT=<sha> bash docs/perf/scripts/run_s28_1.sh`
# (carry [".whl"]).
# 0. Issue 20: host time per plan call at t = 2 (s27 measured it on an H100 host only, where a bare torch.mm cost 50-68
#    us; the issue asks for the H200 pair's hosts: the card that ran is in the header of host_t2.out).
# 1. Issue 25: the MoE layer's recomputed parity test after 36620b4 (cut by its step's time limit in s27 call 4).
# 2. Issue 21: the smoke's four TP ops under graphs against the GEMM alone and cuBLAS + NCCL (bench ops, M 4096 = micro
#    batch 2 x s 2048): how much of the signaled GEMMs' 2.2 ms more per step (s27's profile) is compute at these
#    shapes, how much the overlap's waits.
# 3. Issue 21: the smoke recipe off / signal under its full_iteration graphs, up to three runs each, alternating, unprofiled
#    (s27 call 3: off 41.7 / 43.8, signal 41.6 ms: a tie from one signal run; predicted a tie again: the replayed
#    graph is 4.5% shorter with signal, and the eager third of the step is Megatron's).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s28_1
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step host_t2 60 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10
grep "^op=" $W/host_t2.out | cut -c1-400
step moe_recomputed 150 python3 -m pytest -m gpu -v -rA --durations=0 --tb=short $REPO/tests/gpu/test_moe_layer_gpu.py \
  -k recomputed -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed|s call" $W/moe_recomputed.out | grep -v "^\.\./" | tail -4
step ops_smoke 100 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops rs,ag --shapes smoke.proj,smoke.fc2 \
  --ag-shapes smoke.qkv,smoke.fc1 --seq 4096 --ag-seq 4096 --reps 50 --out $W --name ops_smoke_t2
grep -E "^\| smoke" $W/ops_smoke_t2.md | cut -c1-300
for i in 1 2 3; do
  for mode in off signal; do
    train smoke-$mode-$i 70 OVERLAP=$mode TRAIN_ITERS=40 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh
  done
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/smoke-*/train.log | sed "s#$W/##" | tee $W/smoke.md
