# Session 31's first call (4 GPUs, 4 x H200 with needs_h200; 505 s), written in session 30:
# `COMMIT=<sha> bash docs/perf/scripts/run_s31_2.sh` (carry [".whl"]). llama3-8b at TP 4 end to end (32 layers, local
# graphs), where one layer gathering in place measured 0.913 of Megatron's against 0.957 staged (session 30): off,
# signal gathering in place (the recipe's default), signal staged, interleaved. Never run end to end at
# TP 4 before. Predicted: in place 1.03-1.05x of off (the layer's 8.7% over off diluted by the embedding, output layer
# and optimizer, as at TP 2 where the layer's 5.6% gave 3.1%), staged ~2 points less.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s31_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
# test_gemm_ar at t = 4 (moved here from run_s31_1.sh in session 31): it failed there in session 21 (tile_exact
# against its sequential twin); session 23 found the cause in the test and fixed it; the fixed test has not run at t = 4.
step gemm_ar_t4 60 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider $REPO/tests/gpu/test_gemm_rs_gpu.py \
  -k test_gemm_ar
grep -E "PASSED|FAILED|passed|failed" $W/gemm_ar_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -3
# Then the token-split probe at t = 4 (probe_token_split.py: whether one half's pulls run beside the other half's
# GEMM on one hardware queue and in a graph), with and without the attention stand-in.
step probe_split 45 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_token_split.py
step probe_split_attn 45 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_token_split.py --attn
grep -h -E "^(t = |eager|graph)" $W/probe_split*.out
i=0
for run in inplace off staged inplace off; do
  i=$((i + 1))
  gather=1; [[ $run == staged ]] && gather=0
  mode=signal; [[ $run == off ]] && mode=off
  train l8b32-t4-$run-$i 90 GRAPHS=local TP=4 NPROC=4 OVERLAP=$mode GATHER_IN_PLACE=$gather TRAIN_ITERS=14 GBS=8 -- \
    $REPO/recipes/llama3-8b.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 6 $W/l8b32-*/train.log | sed "s#$W/##" | tee $W/l8b32_t4.md
grep -h "symmetric memory" $W/l8b32-t4-inplace-1/train.log | head -1 | cut -c1-250
grep -h -E "Error|error:|Traceback|OutOfMemory" $W/*/train.log | sort | uniq -c | head -8
