"""The blockwise FP8 GEMM's main loop in Gluon (Triton's lower-level language, sm_90): the promotion of one K step
runs while the next K step's MMAs are in flight, which Triton's own pipeliner cannot schedule (an MMA result read by
anything but the next MMA's accumulator is waited for at once: fp8_blockwise_variants.py). An experiment beside the
variants there, timed by that script as the variant `gluon`; the winner moves into kernels/fp8_gemm.py.

C [M, N] bf16 = (A * sa) @ (W * sw).T; A [M, K] e4m3, 1x128 scales stored [K/128, M]; W [N, K] e4m3, 128x128 scales
stored [ceil(N/128), sw_ld]; K a multiple of 256, BLOCK_N <= 128 (one weight scale per tile per K step), M a
multiple of BLOCK_M = 16 * num_warps. Per program, persistent over the output tiles (grouped by GROUP_M rows of
tiles), two K steps per iteration:

    loads: a STAGES-deep ring of A and W tiles in shared memory, filled by TMA, one mbarrier per stage; a load goes
           into the stage whose previous K step has finished (step ks + STAGES - 2 at the iteration's start, step
           ks + STAGES - 1 once step ks's MMAs are done)
    X = A_ks @ W_ks.T, Y = A_ks+1 @ W_ks+1.T      both issued asynchronously, each into a fresh accumulator
    wait until only Y is in flight;  acc += X * (sa[:, ks] * sw[ks])[:, None]        while Y's MMAs run
    wait for Y;                      acc += Y * (sa[:, ks+1] * sw[ks+1])[:, None]
    after the K loop: acc stored as bf16

Nothing in flight crosses an iteration: a product carried from one iteration to the next in flight is a register
copy of a running wgmma's accumulator, which ptxas answers by serialising every wgmma of the kernel. Three fp32
tiles live at once (acc, X, Y): 64x128 on one warpgroup is 192 registers a thread for them; with STAGES = 4 the ring
takes 96 KB, so two programs fit an SM (--programs-per-sm 2), one promoting while the other's MMAs run, as
DeepGEMM's two math warpgroups do. `compile_sm90` builds the kernel for sm_90 without a GPU (the CPU test reads its
SASS: no serialised wgmma, the promotion of X between the wait for one group and the wait for none).
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# TMA's global-to-shared load: async_load from Triton 3.7, async_copy_global_to_shared before (the device's 3.6)
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.jit
def _issue_load(a_desc, w_desc, a_smem, w_smem, ready, row0, col0, ks, i, STAGES: gl.constexpr,
                BLOCK_K: gl.constexpr):
    """Load K step ks of the tile at (row0, col0) into stage i % STAGES (i: the program's load count)."""
    s = i % STAGES
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
    _tma_load(a_desc, [row0, ks * BLOCK_K], bar, a_smem.index(s))
    _tma_load(w_desc, [col0, ks * BLOCK_K], bar, w_smem.index(s))


@gluon.jit
def blockwise_gluon_kernel(a_desc, w_desc, c_ptr, sa_ptr, sw_ptr, sw_ld, M, N, K,
                           NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                           num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    k_steps = K // BLOCK_K
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    loaded = 0     # loads issued by this program so far: stage and phase of each
    consumed = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = gl.minimum(tiles_m - first_m, GROUP_M)
        row0 = (first_m + (tile % (GROUP_M * tiles_n)) % rows_in_group) * BLOCK_M
        col0 = ((tile % (GROUP_M * tiles_n)) // rows_in_group) * BLOCK_N
        sa_ptrs = sa_ptr + row0 + gl.arange(0, BLOCK_M, layout=rows_layout)
        sw_row_ptr = sw_ptr + (col0 // 128) * sw_ld

        for ks in gl.static_range(STAGES - 2):   # the ring's first stages (k_steps >= STAGES - 2)
            _issue_load(a_desc, w_desc, a_smem, w_smem, ready, row0, col0, ks, loaded + ks, STAGES, BLOCK_K)
        loaded += STAGES - 2

        acc = zero
        for ks in range(0, k_steps, 2):
            if ks + STAGES - 2 < k_steps:   # into the stage K step ks - 2 used (finished last iteration)
                _issue_load(a_desc, w_desc, a_smem, w_smem, ready, row0, col0, ks + STAGES - 2, loaded, STAGES,
                            BLOCK_K)
                loaded += 1
            first = consumed % STAGES
            mbarrier.wait(ready.index(first), (consumed // STAGES) & 1)
            x = warpgroup_mma(a_smem.index(first), w_smem.index(first).permute((1, 0)), zero, use_acc=False,
                              is_async=True)
            second = (consumed + 1) % STAGES
            mbarrier.wait(ready.index(second), ((consumed + 1) // STAGES) & 1)
            y = warpgroup_mma(a_smem.index(second), w_smem.index(second).permute((1, 0)), zero, use_acc=False,
                              is_async=True)
            consumed += 2
            x_scale = gl.load(sa_ptrs + ks * M) * gl.load(sw_row_ptr + ks)
            y_scale = gl.load(sa_ptrs + (ks + 1) * M) * gl.load(sw_row_ptr + ks + 1)
            x = warpgroup_mma_wait(num_outstanding=1, deps=(x, ))
            acc += x * x_scale[:, None]     # while y's MMAs run
            if ks + STAGES - 1 < k_steps:   # into the stage K step ks - 1 used (finished last iteration)
                _issue_load(a_desc, w_desc, a_smem, w_smem, ready, row0, col0, ks + STAGES - 1, loaded, STAGES,
                            BLOCK_K)
                loaded += 1
            y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
            acc += y * y_scale[:, None]

        rows = row0 + gl.arange(0, BLOCK_M, layout=rows_layout)
        cols = col0 + gl.arange(0, BLOCK_N, layout=cols_layout)
        gl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(gl.bfloat16),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


def launch(a, w, out, tile, num_programs):
    """A callable running the kernel on ScaledFp8 a (1x128) and w (128x128) into out (bf16 [M, N]); tile is
    (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps) with BLOCK_K 128, BLOCK_N <= 128, BLOCK_M = 16 * num_warps,
    STAGES >= 3; K a multiple of 256."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    bm, bn, bk, stages, warps = tile
    m, k = a.q.shape
    n = w.q.shape[0]
    if (bk != 128 or bn > 128 or bm != 16 * warps or m % bm or k % (2 * bk) or k // bk < stages - 2
            or stages < 3):
        raise ValueError(f"gluon does not take tile {bm}x{bn}x{bk}/{stages}/{warps} at M={m}, K={k}")
    a_desc = TensorDescriptor(a.q, list(a.q.shape), list(a.q.stride()), [bm, bk],
                              gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float8e4nv))
    w_desc = TensorDescriptor(w.q, list(w.q.shape), list(w.q.stride()), [bn, bk],
                              gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float8e4nv))
    grid = (max(1, min(num_programs, -(-m // bm) * -(-n // bn))),)

    def call():
        blockwise_gluon_kernel[grid](a_desc, w_desc, out, a.ds, w.ds, w.ds.shape[1], m, n, k,
                                     NUM_PROGRAMS=grid[0], GROUP_M=8, STAGES=stages, num_warps=warps)
    return call


def compile_sm90(block_m=64, block_n=128, stages=4, num_warps=4):
    """The kernel compiled for sm_90 without a GPU: Triton's CompiledKernel (its .asm holds ttgir, ptx, cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    def desc(rows):   # the signature of a TensorDescriptor argument: tensordesc<dtype[block],layout>
        layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)
        return f"tensordesc<fp8e4nv[{rows}, 128],{layout!r}>"
    signature = {"a_desc": desc(block_m), "w_desc": desc(block_n), "c_ptr": "*bf16", "sa_ptr": "*fp32",
                 "sw_ptr": "*fp32", "sw_ld": "i32", "M": "i32", "N": "i32", "K": "i32", "NUM_PROGRAMS": "constexpr",
                 "GROUP_M": "constexpr", "STAGES": "constexpr", "num_warps": "constexpr"}
    constexprs = {"NUM_PROGRAMS": 132, "GROUP_M": 8, "STAGES": stages, "num_warps": num_warps}
    names = list(signature)
    src = GluonASTSource(blockwise_gluon_kernel, signature,
                         constexprs={(names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
