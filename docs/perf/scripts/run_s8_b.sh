# Session 8, call 2 (nvidia-h200-x2): the layer benchmark with interleaved rounds, twice (run-to-run spread),
# then once with the previous layers.py (NCCL re-gather for the column wgrad) installed over the package.
source .diag/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
W=/tmp/w8b; rm -rf $W; mkdir -p $W
pack() { cd $W && tar czf $OUT/s8_b.tgz . ; }
trap pack EXIT
for run in a b; do
  timeout 200 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --reps 50 --rounds 5 --configs megatron,nocomm,off,signal-agp2p,signal-p2p,signal-auto --out $W --name layer_t2_s8$run > $W/layer_s8$run.log 2>&1; echo "layer $run exit $?"
  grep "^| l\|^- l" $W/layer_t2_s8$run.md | cut -d'|' -f2-7
done
LAYERS=$(python3 -c "import overlap_tp.layers as m; print(m.__file__)")
cp $LAYERS $W/layers_new.py; cp $REPO/.diag/layers_nccl_regather.py $LAYERS
timeout 150 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --reps 50 --rounds 5 --configs megatron,nocomm,signal-agp2p,signal-auto --out $W --name layer_t2_s8_nccl_regather > $W/layer_s8_old.log 2>&1; echo "layer (NCCL re-gather) exit $?"
grep "^| l\|^- l" $W/layer_t2_s8_nccl_regather.md | cut -d'|' -f2-7
cp $W/layers_new.py $LAYERS
