# Session 9, call 3 (nvidia-h200, one GPU): norm GPU tests at eff4b3f; the norm benchmark at eff4b3f, then with
# 2b6a3ff's kernel file (before the load order change) copied over the installed module; then eff4b3f again.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
REPO=$PWD; cd /tmp
INSTALLED=$(python3 -c "import overlap_tp.kernels.fused_add_rmsnorm as m; print(m.__file__)")
cp $INSTALLED /tmp/norm_new.py
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -m gpu $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py -v -p no:cacheprovider > $OUT/gpu_tests_fused_add_rmsnorm.log 2>&1; echo "tests exit $?"; tail -1 $OUT/gpu_tests_fused_add_rmsnorm.log
bench() { timeout 150 python3 -m overlap_tp.bench norm --reps 50 --out $OUT --name $1 > $OUT/$1.log 2>&1; echo "$1 exit $?"; grep -E "fwd fused \||fwd fused, map \||bwd fused \||bwd fused, map \|" $OUT/$1.log | cut -d'|' -f1-9; }
bench fused_add_rmsnorm
cp $REPO/.diag/norm_2b6a3ff.py $INSTALLED; OVERLAP_TP_GIT_COMMIT=2b6a3ff bench norm_loads_lookup_first
cp /tmp/norm_new.py $INSTALLED; bench fused_add_rmsnorm_again
