# Session 15, call 7 (nvidia-h200, ONE GPU): the grouped signaled GEMM's tile shape and raster run against per-expert
# cuBLAS at EP 1, uniform and zipf (scripts/probe_expert_gemm_tiles.py): where the zipf gap comes from.
source docs/perf/scripts/setup_device.sh
workdir s15_seven
[[ -n $SKIP_TILES ]] || step tiles 560 python3 $REPO/docs/perf/scripts/probe_expert_gemm_tiles.py
[[ -n $SKIP_TILES ]] || grep -v -i warn $W/tiles.out | head -80
step raster 300 python3 $REPO/docs/perf/scripts/probe_expert_gemm_tiles.py --tiles default --raster 8,16,32,64,128
grep -v -i warn $W/raster.out | head -40
