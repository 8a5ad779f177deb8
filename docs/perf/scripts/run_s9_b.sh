# Session 9, call 2 (nvidia-h200, one GPU): norm GPU tests and the norm benchmark at the final code (50 reps).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
REPO=$PWD; cd /tmp
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -m gpu $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py -v -p no:cacheprovider > $OUT/gpu_tests_fused_add_rmsnorm.log 2>&1; echo "tests exit $?"; tail -3 $OUT/gpu_tests_fused_add_rmsnorm.log
timeout 300 python3 -m overlap_tp.bench norm --reps 50 --out $OUT --name fused_add_rmsnorm > $OUT/norm.log 2>&1; echo "norm exit $?"
grep -E "fwd fused \||fwd fused, map \||bwd fused" $OUT/norm.log | cut -d'|' -f1-9
