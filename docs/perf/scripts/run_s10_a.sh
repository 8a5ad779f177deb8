# Session 10, call 1 (nvidia-h200-x2): the op layer as plans (issue 20) and under CUDA graphs (issue 21):
# the GPU op tests (graph capture + replay of every op, gemm_rs, ag_gemm), then the operator benchmark at
# t = 2, s 8192, eager with host us per call, and every configuration captured and timed by replay.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1
W=/tmp/w10a; rm -rf $W; mkdir -p $W
pack() { cd $W && tar czf $OUT/s10_a.tgz . ; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $W/device.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $W/device.txt
cat $W/device.txt
timeout 330 python3 -m pytest -m gpu -q -x $REPO/tests/gpu/test_graphs_gpu.py $REPO/tests/gpu/test_gemm_rs_gpu.py \
  $REPO/tests/gpu/test_ag_gemm_gpu.py -rA > $W/gpu_tests_ops_graphs.log 2>&1; echo "gpu tests exit $?"
grep -E "passed|failed|Error|error" $W/gpu_tests_ops_graphs.log | tail -8
timeout 120 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops rs,ag --seq 8192 --ag-seq 8192 --reps 30 \
  --host --out $W --name ops_t2_eager > $W/ops_eager.log 2>&1; echo "ops eager exit $?"
grep "^| " $W/ops_t2_eager.md | cut -c1-400
timeout 120 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops rs,ag --seq 8192 --ag-seq 8192 --reps 30 \
  --graphs --out $W --name ops_t2_graphs > $W/ops_graphs.log 2>&1; echo "ops graphs exit $?"
grep "^| \|not timed" $W/ops_t2_graphs.md $W/ops_graphs.log | cut -c1-400
tail -5 $W/ops_graphs.log
