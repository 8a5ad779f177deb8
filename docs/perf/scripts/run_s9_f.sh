# Session 9, call 6 (nvidia-h200, one GPU): the signaled GEMM alone vs cuBLAS on the layers' GEMMs (TP 2 shards,
# s 8192), interleaved rounds, the default tile with 3 and 4 stages, grids 132 and 116; the same run twice.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
REPO=$PWD; cd /tmp
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
for name in signaled_gemm signaled_gemm_again; do
  timeout 260 python3 -m overlap_tp.bench gemm --seq 8192 --configs 128x256x64/4/8 --out $OUT --name $name > $OUT/$name.log 2>&1; echo "$name exit $?"
  grep -E "^- " $OUT/$name.log
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
grep -E "/3/8 \| 0 " $OUT/signaled_gemm.log | cut -d'|' -f1,6-14
