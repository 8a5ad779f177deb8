# Session 6, call 2 (nvidia-h200-x4): host cost of the ops before (f3bc789, .diag/old) and after the host
# diet, side by side on the two GPU pairs; then the layer benchmark with GPU-only and host columns at t = 2 and 4.
source .diag/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
rm -rf /tmp/old_site; python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old_site $REPO/.diag/old 2>&1 | grep -v -i warn | tail -2
(CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH=/tmp/old_site:/tmp/site timeout 150 torchrun --nproc-per-node 2 --master-port 29700 $REPO/.diag/probe_host.py --ops-only > $OUT/probe_old.log 2>&1; echo "old probe exit $?") &
CUDA_VISIBLE_DEVICES=2,3 timeout 150 torchrun --nproc-per-node 2 --master-port 29600 $REPO/.diag/probe_host.py --ops-only > $OUT/probe_new.log 2>&1; echo "new probe exit $?"
wait
paste -d' ' <(grep "^|" $OUT/probe_old.log) <(grep "^|" $OUT/probe_new.log | cut -d'|' -f3-)
timeout 230 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --reps 20 --out $OUT --name layer_t2_host > $OUT/layer_t2.log 2>&1; echo "layer t2 exit $?"
grep "^|\|^- l" $OUT/layer_t2.log
timeout 200 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --reps 20 --out $OUT --name layer_t4_host > $OUT/layer_t4.log 2>&1; echo "layer t4 exit $?"
grep "^|\|^- l" $OUT/layer_t4.log
cd $OUT && tar czf /tmp/s6_b.tgz . && mv /tmp/s6_b.tgz $OUT/
