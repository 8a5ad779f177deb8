# Session 7, call 2 (nvidia-h200-x2): the norm benchmark with GPU-only (queued) timing and the launch grid;
# the layer benchmark (8B, TP 2) at CUDA_DEVICE_MAX_CONNECTIONS 1 and 8; cProfile of one layer step's host side.
source .diag/setup_device.sh
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
W=/tmp/w7b; mkdir -p $W
pack() { cd $W && tar czf $OUT/s7_b.tgz . ; }
trap pack EXIT
CUDA_VISIBLE_DEVICES=0 timeout 220 python3 -m overlap_tp.bench norm --sweep --out $W --name norm_sweep > $W/norm_sweep.log 2>&1; echo "norm exit $?"
grep "fwd fused |\|bwd fused |\|bwd fused, map |\|fwd fused, map |" $W/norm_sweep.md
for c in 1 8; do
  CUDA_DEVICE_MAX_CONNECTIONS=$c timeout 150 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --models l8b --reps 20 --configs megatron,nocomm,signal-agp2p,signal-p2p --out $W --name layer_t2_conn$c > $W/layer_conn$c.log 2>&1; echo "layer conn $c exit $?"
  grep "^| l8b\|^- l" $W/layer_conn$c.log
done
CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 120 torchrun --nproc-per-node 2 $REPO/.diag/profile_layer_host.py megatron off signal-agp2p > $W/profile_host.log 2>&1; echo "profile exit $?"
grep "^==" $W/profile_host.log
