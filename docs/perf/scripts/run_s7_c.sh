# Session 7, call 3 (nvidia-h200-x2): the fused norm at the new backward defaults, against the same code
# without the backward's prefetch (.diag/noprefetch: only _backward_kernel reverted to 77cdff3's), GPU-only
# timing; the norm GPU tests; the layer benchmark (8B and 70B, TP 2) with the changed norm.
source .diag/setup_device.sh
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
W=/tmp/w7c; mkdir -p $W
pack() { cd $W && tar czf $OUT/s7_c.tgz . ; }
trap pack EXIT
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m overlap_tp.bench norm --out $W --name fused_add_rmsnorm > $W/norm.log 2>&1; echo "norm exit $?"
KFILE=$(python3 -c "import overlap_tp.kernels.fused_add_rmsnorm as m; print(m.__file__)")
cp $KFILE /tmp/prefetch_kernel.py; cp $REPO/.diag/noprefetch/fused_add_rmsnorm.py $KFILE
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m overlap_tp.bench norm --out $W --name norm_noprefetch > $W/norm_noprefetch.log 2>&1; echo "norm noprefetch exit $?"
cp /tmp/prefetch_kernel.py $KFILE
paste -d'|' <(grep "bwd fused |\|bwd fused, map |" $W/norm_noprefetch.md | cut -d'|' -f2-6) <(grep "bwd fused |\|bwd fused, map |" $W/fused_add_rmsnorm.md | cut -d'|' -f5-8)
CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m pytest -m gpu $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py -v -rA --tb=short -p no:cacheprovider > $W/gpu_tests_fused_add_rmsnorm.log 2>&1; echo "norm tests exit $?"; tail -2 $W/gpu_tests_fused_add_rmsnorm.log
export CUDA_DEVICE_MAX_CONNECTIONS=1
timeout 280 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --reps 30 --configs megatron,nocomm,off,signal-agp2p --out $W --name layer_t2_s7 > $W/layer.log 2>&1; echo "layer exit $?"
grep "^| l\|^- l" $W/layer.log
