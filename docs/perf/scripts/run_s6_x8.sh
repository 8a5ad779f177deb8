# Session 6, call 4 (nvidia-h200-x8, first time lent): t = 8. GPU tests (gemm_rs / ag_gemm), ops benchmark
# at s 8192, GEMM+A2A at EP 8, llama3-70b-proxy TP 8 on/off. Everything is packed into one tgz at the end.
source .diag/setup_device.sh
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
W=/tmp/w8; rm -rf $W; mkdir -p $W
nvidia-smi topo -m > $W/topo_h200x8.txt 2>&1; head -10 $W/topo_h200x8.txt | cut -c1-80
pack() { cd $W && tar czf $OUT/s6_x8.tgz . ; }
trap pack EXIT
for m in signal off; do
  TP=8 NPROC=8 OVERLAP=$m OUT_DIR=$W/l70b-tp8-$m TRAIN_ITERS=12 GBS=4 LOG_INTERVAL=2 NUM_LAYERS=16 WANDB_PROJECT= \
    timeout 100 bash $REPO/recipes/llama3-70b-proxy.sh --lr 3e-5 --min-lr 3e-6 > /dev/null 2>$W/l70b-tp8-$m.err; echo "== tp8 $m exit $?"
  log=$W/l70b-tp8-$m/train.log; tail -2 $W/l70b-tp8-$m.err
  grep -E "memory \(MB\)" $log | head -1; grep "\[overlap_tp\]" $log | tail -1
  grep -E " iteration +[0-9]+/" $log | tail -1 | tr '|' '\n' | grep -E "lm loss|elapsed|throughput"; grep -iE "Error|Traceback" $log | head -3
done
python3 -m overlap_tp.report $W/l70b-tp8-off/train.log $W/l70b-tp8-signal/train.log --out $W/l70b-tp8-report 2>&1 | tail -3
for m in signal off; do echo "-- losses $m"; grep -oE "iteration +[0-9]+/.*lm loss: [0-9.E+-]+" $W/l70b-tp8-$m/train.log | sed -E 's/\|.*lm loss//' | tr '\n' ' '; echo; done
export CUDA_DEVICE_MAX_CONNECTIONS=1
OVERLAP_TP_GPU_WORLD=8 timeout 130 python3 -m pytest -m gpu $REPO/tests/gpu/test_gemm_rs_gpu.py $REPO/tests/gpu/test_ag_gemm_gpu.py \
  -k "s8192 or gemm_ar or back_to_back or late or raw_nccl or async" -v -rA --tb=short --timeout 100 --durations=0 -p no:cacheprovider > $W/gpu_tests_t8.log 2>&1
echo "== gpu tests t8 exit $?: $(grep -cE '::.* PASSED' $W/gpu_tests_t8.log) passed"; grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" $W/gpu_tests_t8.log | tail -4
timeout 120 torchrun --nproc-per-node 8 -m overlap_tp.bench ops --seq 8192 --ag-seq 8192 --reps 20 --out $W --name ops_t8 > $W/ops_t8.log 2>&1
echo "== ops t8 exit $?"; grep "^|" $W/ops_t8.log | head -40
timeout 80 torchrun --nproc-per-node 8 -m overlap_tp.bench moe --tokens 8192,16384 --routing uniform,zipf --reps 20 \
  --out $W --name moe_ops_ep8 > $W/moe_ops_ep8.log 2>&1; echo "== moe ep8 exit $?"; grep "|" $W/moe_ops_ep8.log | tail -12
