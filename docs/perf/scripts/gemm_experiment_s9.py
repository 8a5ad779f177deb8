# Session 9 experiment (one GPU): where the signaled GEMM loses to cuBLAS on the layers' GEMMs.
# V_table: the library kernel (plan table, pointer-store epilogue), raster group G in {4, 8, 16, 32};
# V_arith: the same kernel body with tile coordinates computed (grouped raster), no table;
# V_tma:   V_arith with a TMA-store epilogue. Registers/spills of each. All at 132 SMs, bf16.
import statistics, sys
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from overlap_tp import OverlapConfig
from overlap_tp.kernels import signaled_gemm as S
from overlap_tp.plan import row_slice_plan

dev = torch.device("cuda")
NSM = torch.cuda.get_device_properties(dev).multi_processor_count


def timed(fn, reps=40):
    fn(); torch.cuda.synchronize()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        st[i].record(); fn(); en[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(st, en))


@triton.jit
def arith_kernel(a_desc, w_desc, c_ptr, c_desc, M, N, K, GROUP_M: tl.constexpr, TMA_STORE: tl.constexpr,
                 W_KN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_PROGRAMS: tl.constexpr):
    k_steps = tl.cdiv(K, BLOCK_K)
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    num_tiles = m_tiles * n_tiles
    for e in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        group = e // (GROUP_M * n_tiles)
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(m_tiles - first_m, GROUP_M)
        pm = first_m + (e % (GROUP_M * n_tiles)) % rows_in_group
        pn = (e % (GROUP_M * n_tiles)) // rows_in_group
        row = pm * BLOCK_M
        col = pn * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([row, ks * BLOCK_K])
            if W_KN:
                w = w_desc.load([ks * BLOCK_K, col])
                acc = tl.dot(a, w, acc)
            else:
                w = w_desc.load([col, ks * BLOCK_K])
                acc = tl.dot(a, w.T, acc)
        if TMA_STORE:
            c_desc.store([row, col], acc.to(tl.bfloat16))
        else:
            rows = row + tl.arange(0, BLOCK_M)
            cols = col + tl.arange(0, BLOCK_N)
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=mask)


GEMMS = [  # name, M, K, N, layout
    ("l8b.qkv fwd", 8192, 4096, 3072, "nk"), ("l8b.fc1 fwd", 8192, 4096, 14336, "nk"),
    ("l8b.proj fwd", 8192, 2048, 4096, "nk"), ("l8b.fc2 fwd", 8192, 7168, 4096, "nk"),
    ("l8b.fc1 dgrad", 8192, 14336, 4096, "kn"), ("l8b.fc2 dgrad", 8192, 4096, 7168, "kn"),
    ("l70b.proj fwd", 8192, 4096, 8192, "nk"), ("l70b.qkv dgrad", 8192, 5120, 8192, "kn"),
]
cfg = OverlapConfig(method="signal", comm_sms=0)
bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
print(f"{'gemm':16s} {'cuBLAS':>7s} " + " ".join(f"{h:>9s}" for h in
      ["tbl G4", "tbl G8", "tbl G16", "tbl G32", "ar G8", "ar G16", "tma G8", "tma G16"]), flush=True)
spill_info = {}
for name, m, k, n, layout in GEMMS:
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w_rows = torch.randn(*((k, n) if layout == "kn" else (n, k)), device=dev, dtype=torch.bfloat16) / k ** 0.5
    w = w_rows.t() if layout == "kn" else w_rows
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    want = (a @ w.t()).float()
    res = [timed(lambda: torch.matmul(a, w.t()))]
    for g in (4, 8, 16, 32):
        tiles = row_slice_plan(m, n, 1, bm, bn, groups=1, raster_group_m=g).tiles.to(dev)
        S.signaled_gemm(a, w, out, tiles, None, NSM, cfg)
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().mean().item())
        res.append(timed(lambda: S.signaled_gemm(a, w, out, tiles, None, NSM, cfg)))
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w_rows, [bk, bn] if layout == "kn" else [bn, bk])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    for tma in (False, True):
        for g in (8, 16):
            def run():
                return arith_kernel[(NSM,)](a_desc, w_desc, out, c_desc, m, n, k, GROUP_M=g, TMA_STORE=tma,
                                            W_KN=layout == "kn", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGRAMS=NSM,
                                            num_stages=cfg.num_stages, num_warps=cfg.num_warps)
            out.fill_(float("nan"))
            compiled = run()
            torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().mean().item())
            spill_info[("arith", tma, layout)] = (compiled.n_regs, compiled.n_spills, compiled.metadata.shared)
            res.append(timed(run))
    print(f"{name:16s} {res[0]:7.3f} " + " ".join(f"{res[0] / r:9.3f}" for r in res[1:]), flush=True)

# registers / spills of the library kernel
for layout in ("nk", "kn"):
    key = [k for k in S.signaled_gemm_kernel.device_caches[0][0].keys()]
for key, kern in S.signaled_gemm_kernel.device_caches[0][0].items():
    print("library kernel: regs", kern.n_regs, "spills", kern.n_spills, "smem", kern.metadata.shared)
for k, v in spill_info.items():
    print("arith kernel", k, "regs/spills/smem", v)
