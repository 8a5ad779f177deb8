# Session 36's third four-GPU call (~9 min): `COMMIT=<sha> bash docs/perf/scripts/run_s36_x4_3.sh` (carry [".whl"]).
# After call 2 (rs_transfer 'copy' at t = 4: the 8B layer 1.045 -> 1.034 of the counterfactual, the 70B layer
# 1.009 -> 0.984, three of four GEMM+RS shapes faster):
# 1. t = 2 on GPUs 0-1 (where 'auto' keeps the epilogue's stores): the copy configs' GPU tests (test_gemm_rs_gpu.py
#    s 8192 and odd shapes), `bench ops --graphs` on the four GEMM+RS shapes, one 8B and one 70B layer in place with
#    the partials by epilogue (the default) and by copy: does 'copy' win at t = 2 too?
# 2. the 70B proxy at TP 4 (16 layers, local graphs), the recipe's defaults (copy) against
#    --overlap-tp-rs-transfer epilogue, one pair (predicted from the layer: -2.4%).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s36_x4_3
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
CUDA_VISIBLE_DEVICES=0,1 step rs_tests_t2 110 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_gemm_rs_gpu.py -k "s8192 or odd"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/rs_tests_t2.out | grep -v "^\.\./" | cut -c1-300 | tail -4
CUDA_VISIBLE_DEVICES=0,1 step ops_rs_t2 70 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops rs \
  --seq 8192 --reps 30 --out $W --name ops_rs_t2
grep -E "^\| rs " $W/ops_rs_t2.md | cut -c1-240
CUDA_VISIBLE_DEVICES=0,1 step layer_t2 130 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs \
  --models l8b,l70b --seq 8192 --configs megatron,nocomm,signal-p2p-inplace,signal-p2p-rscopy-inplace --reps 10 \
  --rounds 2 --out $W --name layer_t2_rs
grep -E "^\| l(8|70)b " $W/layer_t2_rs.md | cut -c1-200
i=0
for run in copy epilogue; do
  i=$((i + 1)); extra=(); [[ $run == epilogue ]] && extra=(--overlap-tp-rs-transfer epilogue)
  train l70b16-t4-$run-$i 105 GRAPHS=local TP=4 NPROC=4 NUM_LAYERS=16 OVERLAP=signal TRAIN_ITERS=12 GBS=4 -- \
    $REPO/recipes/llama3-70b-proxy.sh "${extra[@]}"
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 5 $W/l70b16-t4-*/train.log | sed "s#$W/##" | cut -c1-160 | \
  tee $W/l70b16_t4.md
grep -h -E "Error|error:|Traceback|out of memory" $W/*/train.log | sort | uniq -c | head -8
