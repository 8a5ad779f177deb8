# Session 21's second call on the 4-GPU H200 machine (~9 min). First the topology: where two of its GPUs are joined
# as the 2-GPU machine's pair is (NV18: all 18 NVLinks through NVSwitch), issue 21's llama3-8b at 32 layers runs
# on GPUs 0-1 here (session 20's run_s21_x2_1.sh's three runs; the 2-GPU machine's figures are not mixed with these). Then why
# test_gemm_ar failed at t = 4 in call 1 (its message never printed: the step ran out of time first).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s21_x4_2
nvidia-smi topo -m | tee $W/topo.txt | head -6
step gemm_ar_t4 60 python3 -m pytest -m gpu -x -v -rA --tb=long $REPO/tests/gpu/test_gemm_rs_gpu.py -k "test_gemm_ar" \
  -p no:cacheprovider
grep -E "assert|Error|error|passed|failed" $W/gemm_ar_t4.out | grep -v "^\.\./" | head -20
if nvidia-smi topo -m | sed -n 2p | grep -q "NV18"; then
  for mode in off signal decompose; do
    train l8b32-$mode 150 CUDA_VISIBLE_DEVICES=0,1 GRAPHS=local OVERLAP=$mode TRAIN_ITERS=20 GBS=4 -- \
      $REPO/recipes/llama3-8b.sh
  done
  python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b32-*/train.log | tee $W/l8b32.md
  grep -h -E "Error|error:|Traceback|OutOfMemory" $W/*/train.log | sort | uniq -c | head -8
fi
