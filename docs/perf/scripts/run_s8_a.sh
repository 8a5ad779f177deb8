# Session 8, call 1 (nvidia-h200-x2): the column wgrad's re-gather on the copy engines and transport auto
# (gemm_rs p2p for K <= 4096): GPU layer tests (p2p + auto), the layer benchmark at TP 2 on both models, then
# the same benchmark with the previous layers.py (NCCL re-gather) installed over the package (A/B, same call).
source .diag/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
W=/tmp/w8a; rm -rf $W; mkdir -p $W
pack() { cd $W && tar czf $OUT/s8_a.tgz . ; }
trap pack EXIT
timeout 150 python3 -m pytest -m gpu -q $REPO/tests/gpu/test_layers_gpu.py -k p2p -rA > $W/gpu_tests_layers_p2p_auto.log 2>&1; echo "gpu tests exit $?"
tail -3 $W/gpu_tests_layers_p2p_auto.log
timeout 220 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --reps 30 --configs megatron,nocomm,signal-agp2p,signal-p2p,signal-auto --out $W --name layer_t2_s8 > $W/layer_s8.log 2>&1; echo "layer exit $?"
grep "^| l\|^- l" $W/layer_s8.md
LAYERS=$(python3 -c "import overlap_tp.layers as m; print(m.__file__)")
cp $LAYERS $W/layers_new.py; cp $REPO/.diag/layers_nccl_regather.py $LAYERS
timeout 150 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --reps 30 --configs megatron,signal-agp2p,signal-auto --out $W --name layer_t2_s8_nccl_regather > $W/layer_s8_old.log 2>&1; echo "layer (NCCL re-gather) exit $?"
grep "^| l\|^- l" $W/layer_t2_s8_nccl_regather.md
cp $W/layers_new.py $LAYERS
