# Session 9, call 4 (nvidia-h200, one GPU): the signaled GEMM alone vs cuBLAS on the layers' GEMMs at TP 2 shards,
# the default tile and four others, grids 132 and 116.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
REPO=$PWD; cd /tmp
timeout 500 python3 -m overlap_tp.bench gemm --seq 8192 --configs 128x256x64/4/8,128x128x64/4/8,256x128x64/3/8,128x256x128/2/8 --out $OUT --name signaled_gemm_s8192 > $OUT/gemm.log 2>&1; echo "gemm exit $?"
grep -E "^- " $OUT/gemm.log; grep -E "128x256x64/3/8" $OUT/gemm.log | cut -d'|' -f1,6-13
