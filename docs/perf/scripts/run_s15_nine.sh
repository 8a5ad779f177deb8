# Session 15, call 9 (nvidia-h200, ONE GPU): the backward's grouped dgrad GEMMs (weights read transposed in place)
# against per-expert cuBLAS, uniform and zipf, raster runs 8 / 32 / 64: is the MoE layer's zipf gap there?
source docs/perf/scripts/setup_device.sh
workdir s15_nine
step dgrad 400 python3 $REPO/docs/perf/scripts/probe_expert_gemm_tiles.py --dgrad --tiles default --raster 8,32,64
grep -v -i warn $W/dgrad.out | head -40
