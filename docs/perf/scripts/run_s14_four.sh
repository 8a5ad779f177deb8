# Session 14, call 4 (nvidia-h200, ONE GPU): the tile rule's GPU test with its expectation fixed (call 3: a
# GEMM+RS beside 16 NCCL SMs keeps the default tile, as the rule says: 2 default waves against 4 narrow ones),
# and scripts/probe_gemm_variants.py: which structure of a persistent TMA GEMM closes the gap to cuBLAS at the
# smoke's small-K GEMMs (0.84-0.87x) and the 8B layer's (0.98x).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1
workdir s14_four
step gpu_rule 120 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_tile_rule_gpu.py -p no:cacheprovider
step variants 300 python3 $REPO/docs/perf/scripts/probe_gemm_variants.py
cat $W/variants.out | grep -v -i warn
