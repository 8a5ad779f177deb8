# Which structure of a persistent Triton GEMM closes the gap to cuBLAS at the smoke recipe's small-K GEMMs (ours
# 0.84-0.87x on qkv / fc1 fwd under graph replays, session 14 call 2) and at the 8B layer's (0.98x)? One GPU,
# every variant and cuBLAS captured in CUDA graphs and timed by replay in interleaved rounds. Variants of one
# plain persistent TMA GEMM (no tile table, no signal): the epilogue as today (masked st.global), as a TMA
# store, as two TMA stores of half tiles (the accumulator split: fewer live registers in the epilogue), and the
# tile loop warp-specialized (a producer warp issuing the TMA loads, where Triton 3.6 supports it on sm90).
#   python3 docs/perf/scripts/probe_gemm_variants.py
import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from overlap_tp import OverlapConfig
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.common import gemm_programs
from overlap_tp.ops.reduction import device_plan
from overlap_tp.tune.timing import CapturedCalls


@triton.jit
def persistent_gemm(a_desc, w_desc, c_desc, c_ptr, M, N, K, NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, STORE: tl.constexpr,
                    WS: tl.constexpr, FLATTEN: tl.constexpr):
    # C[M, N] = A[M, K] @ W[N, K].T; tiles rastered in groups of GROUP_M tile rows (L2 reuse of W's columns)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * tiles_n)) % rows_in_group
        pid_n = (tile % (GROUP_M * tiles_n)) // rows_in_group
        off_m, off_n = pid_m * BM, pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([off_m, ks * BK])
            w = w_desc.load([off_n, ks * BK])
            acc = tl.dot(a, w.T, acc)
        if STORE == 0:      # masked st.global, as kernels/signaled_gemm.py stores
            rows = off_m + tl.arange(0, BM)
            cols = off_n + tl.arange(0, BN)
            tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(tl.bfloat16),
                     mask=(rows < M)[:, None] & (cols < N)[None, :])
        elif STORE == 1:    # one TMA store of the tile
            c_desc.store([off_m, off_n], acc.to(tl.bfloat16))
        else:               # two TMA stores of half tiles [BM, BN / 2]
            halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([off_m, off_n], left.to(tl.bfloat16))
            c_desc.store([off_m, off_n + BN // 2], right.to(tl.bfloat16))


VARIANTS = {   # name: (BM, BN, BK, stages, warps, STORE, WS, FLATTEN)
    "flat.st": (128, 256, 64, 3, 8, 0, False, True),
    "flat.tma": (128, 256, 64, 3, 8, 1, False, True),
    "flat.tma2": (128, 256, 64, 3, 8, 2, False, True),
    "flat.tma2.s4": (128, 256, 64, 4, 8, 2, False, True),
    "ws.tma2": (128, 256, 64, 3, 8, 2, True, False),
    "ws.tma2.w4": (128, 128, 64, 4, 4, 2, True, False),
    "ws.st": (128, 256, 64, 3, 8, 0, True, False),
}
SHAPES = {   # name: (M, N, K), W row-major [N, K]
    "smoke.qkv fwd": (4096, 768, 1024), "smoke.fc1 fwd": (4096, 2816, 1024), "smoke.fc2 fwd": (4096, 1024, 1408),
    "l8b.qkv fwd": (8192, 3072, 4096), "l8b.fc1 fwd": (8192, 14336, 4096), "l8b.proj fwd": (8192, 4096, 2048),
}
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def variant_call(spec, a, w, c):
    bm, bn, bk, stages, warps, store, ws, flatten = spec
    m, k = a.shape
    n = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn if store == 1 else bn // 2])

    def call():
        persistent_gemm[(min(SMS, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)](
            a_desc, w_desc, c_desc, c, m, n, k, NUM_PROGRAMS=SMS, BM=bm, BN=bn, BK=bk, GROUP_M=8, STORE=store,
            WS=ws, FLATTEN=flatten, num_stages=stages, num_warps=warps)
    return call


def ours_call(a, w):
    config = OverlapConfig(method="signal", tile_by_shape=False, comm_sms=0)
    state = device_plan("row_slice", a.shape[0], w.shape[0], 1, config, 2, a.device)
    out = torch.empty(state.plan.staging_shape, device=a.device, dtype=a.dtype)
    programs = gemm_programs(a.device, config)
    return lambda: signaled_gemm(a, w, out, state.tiles, None, programs, config)


def main(rounds=7, replays=10):
    torch.manual_seed(0)
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, {SMS} SMs")
    print("| GEMM | M | N | K | variant | cuBLAS us | variant us | cuBLAS/variant |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (m, n, k) in SHAPES.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        want = a @ w.t()
        calls = {"cuBLAS": lambda: torch.matmul(a, w.t()), "ours": ours_call(a, w)}
        for vname, spec in VARIANTS.items():
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            call = variant_call(spec, a, w, c)
            try:
                call()
                torch.cuda.synchronize()
                err = float((c.float() - want.float()).abs().max())
                if not err < 0.05:
                    print(f"| {name} | {m} | {n} | {k} | {vname} | - | - | wrong (max err {err:.3g}) |")
                    continue
            except Exception as e:   # a variant this Triton cannot compile: reported, not fatal
                print(f"| {name} | {m} | {n} | {k} | {vname} | - | - | {type(e).__name__}: {str(e)[:120]} |")
                continue
            calls[vname] = call
        graphs = {v: CapturedCalls(lambda *_, f=f: f(), [()] * 8) for v, f in calls.items()}
        times = {v: [] for v in calls}
        for _ in range(rounds):
            for v, g in graphs.items():
                times[v].append(statistics.median(g.samples(8 * replays, None)) * 1e3)
        base = statistics.median(times["cuBLAS"])
        for v in calls:
            if v == "cuBLAS":
                continue
            us = statistics.median(times[v])
            print(f"| {name} | {m} | {n} | {k} | {v} | {base:.1f} | {us:.1f} | {base / us:.3f} |", flush=True)
        del graphs


if __name__ == "__main__":
    main()
