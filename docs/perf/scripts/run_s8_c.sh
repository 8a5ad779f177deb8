# Session 8, call 3 (nvidia-h200-x2): the norm benchmark with the same-size copy column (GPU 0), then the layer
# benchmark at TP 2 with 10 interleaved rounds (100 steps per configuration) on the reverted code.
source .diag/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
W=/tmp/w8c; rm -rf $W; mkdir -p $W
pack() { cd $W && tar czf $OUT/s8_c.tgz . ; }
trap pack EXIT
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m overlap_tp.bench norm --out $W --name fused_add_rmsnorm > $W/norm.log 2>&1; echo "norm exit $?"
grep "fwd fused |\|bwd fused |" $W/fused_add_rmsnorm.md
timeout 300 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --reps 100 --rounds 10 --configs megatron,nocomm,off,signal-agp2p,signal-p2p --out $W --name layer_t2_s8_rounds10 > $W/layer.log 2>&1; echo "layer exit $?"
grep "^| l\|^- l" $W/layer_t2_s8_rounds10.md | cut -d'|' -f2-8
