# Session 15, call 7 (nvidia-h200, ONE GPU): the grouped signaled GEMM's tile shape and raster run against per-expert
# cuBLAS at EP 1, uniform and zipf (scripts/probe_expert_gemm_tiles.py): where the zipf gap comes from.
source docs/perf/scripts/setup_device.sh
workdir s15_seven
step tiles 560 python3 $REPO/docs/perf/scripts/probe_expert_gemm_tiles.py
grep -v -i warn $W/tiles.out | head -80
