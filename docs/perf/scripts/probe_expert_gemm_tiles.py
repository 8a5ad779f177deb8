# The grouped signaled GEMM alone (a2a_gemm's fc1 and gemm_a2a's fc2 at EP 1, Mixtral's per-rank shapes: 8192 tokens,
# top-2, 4 experts, H 4096, F 14336) against the per-expert cuBLAS GEMMs, uniform and Zipf(1.2) routing, for several
# tile shapes and raster runs: where session 14-15's zipf gap (the grouped GEMM 0.93x of cuBLAS) comes from.
# CUDA-graph replays of 5 calls each, median of 7 rounds, every variant interleaved within a round.
# --dgrad: the backward's grouped dgrad GEMMs instead (dy @ w[l], the weights read transposed in place: W_KN).
#   python3 docs/perf/scripts/probe_expert_gemm_tiles.py [--raster 1,8,32] [--tiles all|default] [--dgrad]
import argparse, dataclasses, statistics
import torch
from overlap_tp import OverlapConfig
from overlap_tp.bench.moe import routing_counts
from overlap_tp.kernels.signaled_gemm import RowTiles, signaled_gemm
from overlap_tp.ops.common import gemm_programs
from overlap_tp.ops.expert import expert_mm
from overlap_tp.ops.moe_tile_plan import dispatch_plan, layout

dev = torch.device("cuda", 0)
TILES = {"128x256x64/3/8 (default)": dict(), "128x128x64/4/4": dict(block_n=128, num_stages=4, num_warps=4),
         "256x128x64/3/8": dict(block_m=256, block_n=128), "128x256x64/4/8": dict(num_stages=4),
         "64x256x64/4/4": dict(block_m=64, num_stages=4, num_warps=4)}
p = argparse.ArgumentParser()
p.add_argument("--raster", default="1,8,32")
p.add_argument("--tiles", default="all", choices=("all", "default"))
p.add_argument("--dgrad", action="store_true")
args = p.parse_args()
RASTER = tuple(map(int, args.raster.split(",")))
if args.tiles == "default":
    TILES = {name: tile for name, tile in TILES.items() if "default" in name}


def graph_ms(fn, calls=5, rounds=7):
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def one():
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    return one


SHAPES = (("fc1 dgrad", 28672, 4096), ("fc2 dgrad", 4096, 14336)) if args.dgrad else (("fc1", 4096, 28672),
                                                                                     ("fc2", 14336, 4096))
for op, k, n in SHAPES:
    for routing in ("uniform", "zipf"):
        counts = routing_counts(8192, 4, 1, routing)
        lay = layout(counts, 0)
        a = torch.randn(lay.rows, k, device=dev, dtype=torch.bfloat16)
        if args.dgrad:   # the forward's weight [L, K, N] (nn.Linear layout of the forward), read as its transpose
            w = (torch.randn(4, k, n, device=dev, dtype=torch.bfloat16) / k ** 0.5).transpose(1, 2)
        else:
            w = torch.randn(4, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        out = torch.empty(lay.rows, n, device=dev, dtype=torch.bfloat16)
        runs = {"cuBLAS per expert": graph_ms(lambda: expert_mm(a, w, lay.segments, (out,)))}
        for name, tile in TILES.items():
            config = dataclasses.replace(OverlapConfig(method="signal", comm_sms=0), **tile)
            plan = dispatch_plan(lay, n, config.block_m, config.block_n, 1)
            for raster in RASTER:
                tiles = plan.tiles
                tiles = RowTiles(tiles.rows.cuda(), tiles.starts.cuda(), tiles.n_tiles, raster)
                programs = gemm_programs(dev, config)
                runs[f"{name} raster {raster}"] = graph_ms(
                    lambda tiles=tiles, config=config, programs=programs:
                    signaled_gemm(a, w, out, tiles, None, programs, config))
        times = {name: [] for name in runs}
        for _ in range(7):
            for name, one in runs.items():
                times[name].append(one())
        base = statistics.median(times["cuBLAS per expert"])
        rows = [lay.expert_rows(0, 0)]
        print(f"== {op} {routing} (rows per expert {rows[0]}): cuBLAS per expert {base:.3f} ms", flush=True)
        for name, values in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            print(f"   {statistics.median(values):7.3f} ms  cuBLAS/this {base / statistics.median(values):.3f}  {name}")
