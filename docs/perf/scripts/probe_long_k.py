# Which tile closes the signaled GEMM's gap to cuBLAS at long K? Session 23 (probe_remote_epilogue.py, two H100s),
# local stores, every tile of C: proj (K 2048) signaled 187 vs cuBLAS 179 us, qkv dgrad (K 3072) 277 vs 267, fc2
# (K 7168) 671 vs 605 (+11%), fc1 dgrad (K 14336) 1346 vs 1182 (+14%): the gap grows with K, so it is the main loop,
# not the epilogue (which the remote stores add to: +58-114 us against cuBLAS's +38-85). Here, one GPU, the kernel
# alone over a plan of every tile (no signal, no wait), local stores, at the 8B layer's four GEMM+ReduceScatter shapes
# and 70B's fc2 at t = 2, for tiles around the default (128x256x64, 3 stages, 8 warps): more stages, a deeper K step,
# the transposed tile, the narrow tile; against cuBLAS. Each variant and cuBLAS captured in a CUDA graph and timed by
# replay, in interleaved rounds (the median of the rounds' medians). A variant that does not compile (shared memory,
# registers) prints why and is skipped. Prediction: 4 stages or BK 128 recovers half of the long-K gap (the
# load latency is what 3 stages of 64 hide least at K 14336); nothing changes at K 2048.
#   torchrun --nproc-per-node 1 docs/perf/scripts/probe_long_k.py
import dataclasses
import statistics

import torch
import torch.distributed as dist

from overlap_tp import OverlapConfig
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.common import gemm_programs
from overlap_tp.ops.reduction import device_plan
from overlap_tp.tune.timing import graph_timed

torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
group, device = dist.group.WORLD, torch.device("cuda")
M, REPS, ROUNDS = 8192, 20, 3
SHAPES = {   # name: (N, K, weight layout: "nk" = W [N, K] row-major, "kn" = the transposed view of a [K, N])
    "l8b proj": (4096, 2048, "nk"), "l8b qkv dgrad": (4096, 3072, "kn"), "l8b fc2": (4096, 7168, "nk"),
    "l8b fc1 dgrad": (4096, 14336, "kn"), "l70b fc2": (8192, 14336, "nk"),
}
BASE = OverlapConfig(method="signal", comm_sms=0, tile_by_shape=False)
TILES = {
    "default 128x256x64 s3 w8": {},
    "s4": dict(num_stages=4),
    "BK128 s2": dict(block_k=128, num_stages=2),
    "256x128x64 s3": dict(block_m=256, block_n=128),
    "narrow 128x128x64 s4 w4": dict(block_n=128, num_stages=4, num_warps=4),
    "128x128x128 s3 w4": dict(block_n=128, block_k=128, num_stages=3, num_warps=4),
}

for name, (n, k, layout) in SHAPES.items():
    torch.manual_seed(k + n)
    a = torch.randn(M, k, device=device, dtype=torch.bfloat16)
    if layout == "kn":
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16).div_(k ** 0.5).t()
    else:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16).div_(k ** 0.5)
    out = torch.empty(M, n, device=device, dtype=torch.bfloat16)
    ref = a.float() @ w.float().t()
    calls = {"cuBLAS": lambda: torch.mm(a, w.t(), out=out)}
    for label, fields in TILES.items():
        config = dataclasses.replace(BASE, **fields)
        plan = device_plan("row_slice", M, n, 1, config, 2, device)   # one region, one group: every tile
        programs = gemm_programs(device, config)

        def call(config=config, plan=plan, programs=programs):
            signaled_gemm(a, w, out, plan.tiles, None, programs, config)
        try:
            out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
        except Exception as e:   # a tile this kernel cannot compile here: say why, go on
            print(f"{name} {label}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
            continue
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < 1e-2, (name, label, err)
        calls[label] = call
    rounds = {label: [] for label in calls}
    for _ in range(ROUNDS):
        for label, call in calls.items():
            rounds[label].append(graph_timed(call, [()], REPS, group) * 1e3)
    us = {label: statistics.median(v) for label, v in rounds.items()}
    print(f"{name} (N {n}, K {k}, {layout}): " + "; ".join(
        f"{label} {t:.1f} us ({t / us['cuBLAS']:.3f})" for label, t in us.items()), flush=True)
