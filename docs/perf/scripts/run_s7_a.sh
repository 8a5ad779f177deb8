# Session 7, call 1 (nvidia-h200-x2): the fused norm with the prefetching backward (and the launch grid
# sweep) vs the previous kernel (HEAD 77cdff3, .diag/old) on GPU 0; the norm GPU tests; then the layer
# benchmark at TP 2 (8B) with profiler traces of megatron / nocomm / off / signal-agp2p.
source .diag/setup_device.sh
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
W=/tmp/w7a; mkdir -p $W
pack() { cd $W && tar czf $OUT/s7_a.tgz . ; }
trap pack EXIT
rm -rf /tmp/old_site; python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old_site $REPO/.diag/old 2>&1 | grep -v -i warn | tail -2
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m overlap_tp.bench norm --sweep --out $W --name norm_new > $W/norm_new.log 2>&1; echo "norm new exit $?"
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/old_site:/tmp/site timeout 120 python3 -m overlap_tp.bench norm --out $W --name norm_old > $W/norm_old.log 2>&1; echo "norm old exit $?"
grep "bwd fused |\|bwd fused, map |\|fwd fused |" $W/norm_old.md
grep "bwd fused |\|bwd fused, map |\|fwd fused |" $W/norm_new.md
(CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -m gpu $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py -v -rA --tb=short -p no:cacheprovider > $W/gpu_tests_norm.log 2>&1; echo "norm tests exit $?"; tail -3 $W/gpu_tests_norm.log) 
export CUDA_DEVICE_MAX_CONNECTIONS=1
timeout 200 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --models l8b --reps 10 --configs megatron,nocomm,off,signal-agp2p --profile $W/profile --profile-steps 2 --out $W --name layer_t2_profile > $W/layer.log 2>&1; echo "layer exit $?"
grep "^|\|^- l" $W/layer.log
ls -la $W/profile | head
