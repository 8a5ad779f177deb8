# Session 6, call 1 (nvidia-h200-x4): host cost probe at t = 4 (layer) and t = 2 (ops + layer), and the
# tuner's validation at t = 2 over 6 GEMM+RS shapes not validated before, on the other GPU pair.
source .diag/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpus.txt
timeout 150 torchrun --nproc-per-node 4 $REPO/.diag/probe_host.py --layer-only > $OUT/probe_t4.log 2>&1; echo "t4 probe exit $?"
grep -v -i "warn" $OUT/probe_t4.log | grep "^|\|^##" 
CUDA_VISIBLE_DEVICES=2,3 timeout 380 torchrun --nproc-per-node 2 --master-port 29600 -m overlap_tp.tune --op rs \
  --shapes l8b.proj.s4096,l8b.fc2.s4096,l70b.proj.s4096,l70b.fc2.s8192,l8b.fc2.s16384,l70b.proj.s16384 \
  --validate $OUT/tv2 --points 16 --top 6 --reps 10 > $OUT/tune_t2.log 2>&1 &
CUDA_VISIBLE_DEVICES=0,1 timeout 300 torchrun --nproc-per-node 2 $REPO/.diag/probe_host.py > $OUT/probe_t2.log 2>&1; echo "t2 probe exit $?"
grep -v -i "warn" $OUT/probe_t2.log | grep -v "^\s*$" | head -250
wait; echo "tune exit $?"; tail -12 $OUT/tune_t2.log
cd $OUT && tar czf /tmp/s6_probe.tgz . && mv /tmp/s6_probe.tgz $OUT/
