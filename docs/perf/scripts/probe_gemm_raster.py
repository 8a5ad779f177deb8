# The signaled GEMM's tile order and pipeline depth on ONE GPU: the raster group (tile rows that share W's
# N-tiles in L2) and num_stages, for the wide-N GEMMs where it trails cuBLAS (dense l8b.fc1 0.961-0.966,
# grouped MoE fc1 0.966-0.975: session 12's probe_moe_one_gpu) and a control (l8b.qkv). Every variant and
# cuBLAS interleaved in rounds (CUDA events, back-to-back calls); ratios are cuBLAS / variant from the same rounds.
#   python3 docs/perf/scripts/probe_gemm_raster.py
import statistics
import torch
from overlap_tp import OverlapConfig
from overlap_tp.bench.moe import routing_counts
from overlap_tp.kernels.signaled_gemm import SignaledGemm
from overlap_tp.ops import moe_tile_plan
from overlap_tp.ops.common import gemm_programs
from overlap_tp.ops.expert import expert_mm

dev = torch.device("cuda", 0)
ORIGINAL = moe_tile_plan.raster_index
# name: (experts, rows, K, N): dense GEMMs are one expert
SHAPES = {"l8b.fc1 (dense)": (1, 8192, 4096, 14336), "l70b.fc1 (dense)": (1, 8192, 8192, 28672),
          "l8b.qkv (dense)": (1, 8192, 4096, 3072), "moe fc1 uniform.t8192": (4, None, 4096, 28672),
          "moe fc2 uniform.t8192": (4, None, 14336, 4096)}
VARIANTS = [(g, s) for g in (4, 8, 16, 32) for s in (3, 4)]


def batch_ms(fn, reps=10):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


print("| GEMM | M | K | N | raster group | stages | cuBLAS ms | ours ms | cuBLAS/ours |")
print("|---|---|---|---|---|---|---|---|---|")
for name, (experts, rows, k, n) in SHAPES.items():
    counts = routing_counts(8192, experts, 1, "uniform") if rows is None else torch.tensor([[rows]])
    lay = moe_tile_plan.layout(counts, 0)
    a = torch.randn(lay.rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    out = torch.empty(lay.rows, n, device=dev, dtype=torch.bfloat16)
    calls = {"cublas": lambda: expert_mm(a, w, lay.segments, (out,))}
    calls["cublas"]()
    ref = out.clone()
    for group_m, stages in VARIANTS:
        config = OverlapConfig(method="signal", comm_sms=0, num_stages=stages)
        moe_tile_plan.raster_index = lambda m, nt, g=group_m: ORIGINAL(m, nt, g)
        plan = moe_tile_plan.dispatch_plan(counts, 0, n, config.block_m, config.block_n, 1)
        moe_tile_plan.raster_index = ORIGINAL
        gemm = SignaledGemm(plan.tiles.to(dev), gemm_programs(dev, config), config)
        out.fill_(float("nan"))
        gemm(a, w, out)
        assert torch.equal(out, ref) or float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
        calls[(group_m, stages)] = lambda gemm=gemm: gemm(a, w, out)
    times = {key: [] for key in calls}
    for _ in range(5):
        for key, fn in calls.items():
            times[key].append(batch_ms(fn))
    base = statistics.median(times["cublas"])
    for key in VARIANTS:
        t = statistics.median(times[key])
        print(f"| {name} | {lay.rows} | {k} | {n} | {key[0]} | {key[1]} | {base:.3f} | {t:.3f} | {base / t:.3f} |",
              flush=True)
