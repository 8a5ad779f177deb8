# Session 9, calls 1 and 2 (nvidia-h200, one GPU). Call 1 ran all three steps at cdd2d4b; its sweep stopped on a wrong
# check of the benchmark's (torch's sum(0) held bitwise equal to the Triton sum), fixed in ed906b6; call 2 ran the sweep
# alone at ed906b6 (the tests and the probe commented out).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
REPO=$PWD; cd /tmp
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -m gpu $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py -q -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_norm.log | tail -4
timeout 120 python3 $REPO/docs/perf/scripts/probe_launch.py > $OUT/probe_launch.log 2>&1; echo "probe exit $?"; head -8 $OUT/probe_launch.log
timeout 420 python3 -m overlap_tp.bench norm --sweep --out $OUT --name norm_sweep_s9 > $OUT/norm_sweep.log 2>&1; echo "norm exit $?"
grep -E "fwd fused \||fwd fused, map \||bwd fused \||bwd fused, map \||partial sum" $OUT/norm_sweep.log | cut -d'|' -f1-8
