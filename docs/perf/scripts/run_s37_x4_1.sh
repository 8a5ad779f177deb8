# Written in session 36 for the next session (4 GPUs, `nvidia-h200-x4` or `nvidia-h100-x4`; ~9 min): `COMMIT=<sha>
# bash docs/perf/scripts/run_s37_x4_1.sh` (carry [".whl"]). After rs_transfer 'copy' (the default at t > 2 since
# session 36: one 8B layer at t = 4 1.045 -> 1.034 of the counterfactual on four H200s, issue 22 asks <= 1.02):
# 1. the GEMM+ReduceScatter's timeline at l8b.proj and l8b.fc2 (t = 4), epilogue / copy / copy with two pushes per
#    peer: the ~14 us between pushes (a wait kernel launched after each push, session 36's layer trace), and the
#    signaled GEMM beside the copy engines (5-9% slower than cuBLAS in the layer: fc2 335 against 306 us) against
#    the same kernel with the epilogue's stores;
# 2. llama3-8b at TP 4 (32 layers, local graphs), off / the defaults / off / the defaults on the same cards (session
#    36's 1.076x / 1.074x ran before copy became the default; copy against epilogue -0.2% in another call).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s37_x4_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
for shape in 8192,1024,4096 8192,3584,4096; do   # l8b.proj, l8b.fc2 at t = 4 (M, K_local, N)
  step rs_timeline_${shape//,/_} 90 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_op_timeline.py --op rs \
    --shape $shape --variants epilogue,copy,copy-g2
  grep -E "^## " $W/rs_timeline_${shape//,/_}.out
done
i=0
for run in off signal off signal; do   # ~85 s each on a warm machine
  i=$((i + 1))
  train l8b32-t4-$run-$i 115 GRAPHS=local TP=4 NPROC=4 OVERLAP=$run TRAIN_ITERS=11 GBS=8 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-8b.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 4 $W/l8b32-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l8b32_t4.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
