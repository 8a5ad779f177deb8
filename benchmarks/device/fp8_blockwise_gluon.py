"""The blockwise FP8 GEMM's main loop in Gluon (Triton's lower-level language, sm_90): the promotion of one K step
runs while the next K step's MMAs are in flight, which Triton's own pipeliner cannot schedule (an MMA result read by
anything but the next MMA's accumulator is waited for at once: fp8_blockwise_variants.py). The library's candidate,
timed by that script as the variant `gluon`: it walks the library's plan tables and ends each tile with the
library's epilogue (kernels/fp8_gemm.py and kernels/signaled_gemm.py: the same fields, the same in-kernel wait and
store-barrier-release signal), so moving it into kernels/ changes no plan.

C = (A * sa) @ (W * sw).T in bf16 (+ bias on the rows that own it); A [M, K] e4m3 with 1x128 scales stored
[G, K/128, M/G] (G = 1: [K/128, M]; a gathered A's shards each with their own), W [N, K] e4m3 with 128x128 scales
stored [ceil(N/128), sw_ld]; K a multiple of 256, BLOCK_N dividing 128 (tiles start at multiples of BLOCK_N, so a
tile has one weight scale per K step), BLOCK_M = 16 * num_warps. Per program, persistent over the plan's tiles, two
K steps per iteration:

    loads: a STAGES-deep ring of A and W tiles in shared memory, filled by TMA, one mbarrier per stage; at an
           iteration's start, K steps ks + STAGES - 2 and ks + STAGES - 1 go into the stages of steps ks - 2 and
           ks - 1, finished in the iteration before
    X = A_ks @ W_ks.T, Y = A_ks+1 @ W_ks+1.T      both issued asynchronously, each into a fresh accumulator
    wait until only Y is in flight;  acc += X * (sa[:, ks] * sw[ks])[:, None]        while Y's MMAs run
    wait for Y;                      acc += Y * (sa[:, ks+1] * sw[ks+1])[:, None]
    after the K loop: bias, the bf16 store at the tile's destination, the CTA barrier and the release signal

Nothing in flight crosses an iteration: a product carried from one iteration to the next in flight is a register
copy of a running wgmma's accumulator, which ptxas answers by serialising every wgmma of the kernel. Three fp32
tiles live at once (acc, X, Y): 64x128 on one warpgroup is 192 registers a thread for them (about 250 in all);
with STAGES = 4 the ring takes 96 KB, so two programs fit an SM (--programs-per-sm 2), one promoting while the
other's MMAs run, as DeepGEMM's two math warpgroups do. `compile_sm90` builds the kernel for sm_90 without a GPU
(the CPU test reads its SASS: no serialised wgmma, the promotion of X between the wait for one group and the wait
for none).

`blockwise_ws_kernel` (the variant `gluon-ws`) is the wide-tile experiment: 128x256 tiles, whose L2 traffic per
flop is half a 64x128 tile's, on two consumer warpgroups that are separate warp-specialised partitions, so no CTA
barrier ties their steps and one promotes while the other's MMAs run. A warpgroup holds its 64x256 accumulator and
a 64x128 product, so it promotes in 128-column halves. It has the same arguments and epilogue as the first (its
one CTA-wide step, the barrier before the signal, is a named barrier of the two consumers).
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.language.core import _aggregate as aggregate

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


# The library's synchronisation helpers (kernels/signaled_gemm.py), as Gluon functions: the same PTX. Gluon calls the
# library's Triton jit functions on a GPU, but not under the CPU interpreter the tests run in (there they are
# interpreted objects), and the CPU tests compile this file.
@gluon.jit
def _cta_barrier_then(value):
    """bar.sync across the CTA, then `value` (kernels/signaled_gemm.py's cta_barrier_then)."""
    return gl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, $1;", "=r,r", [value], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _load_acquire(ptr):
    """ld.acquire.gpu of one int32 word (signaled_gemm.py's load_acquire)."""
    return gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _fence_async_proxy_then(value):
    """fence.proxy.async, then `value` (signaled_gemm.py's fence_async_proxy_then): the TMA loads addressed with
    the result see what the preceding acquire made visible."""
    return gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r", [value],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def blockwise_gluon_kernel(a_desc, w_desc, dst_ptr, ld_dst, dst_offsets_ptr, bias_ptr, bias_row_lo, bias_row_hi,
                           tiles_ptr, num_tiles, counters_ptr, flags_ptr, wait_target,
                           sa_ptr, rows_per_scale, sw_ptr, sw_ld, M, N, K,
                           HAS_BIAS: gl.constexpr, SIGNAL: gl.constexpr, WAIT: gl.constexpr,
                           TILE_FIELDS: gl.constexpr, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr,
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
    loaded = 0     # loads issued by this program so far: stage and phase of each
    consumed = 0
    for e in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        entry = tiles_ptr + e * TILE_FIELDS
        src_row = gl.load(entry + 0)
        src_row_end = gl.load(entry + 1)
        col0 = gl.multiple_of(gl.load(entry + 2), BLOCK_N)
        dst_row = gl.load(entry + 3)
        dst_col = gl.load(entry + 4)
        group = gl.load(entry + 5)
        dst_base = dst_ptr + gl.multiple_of(gl.load(dst_offsets_ptr + gl.load(entry + 6)), 16)
        if WAIT:
            flag = gl.load(entry + 7)
            if flag >= 0:   # the rows' chunk has arrived once flags[flag] reaches the call's target (cyclic)
                while _load_acquire(flags_ptr + flag) - wait_target < 0:
                    pass
                src_row = _fence_async_proxy_then(src_row)   # the TMA loads below are addressed after the fence

        rows = src_row + gl.arange(0, BLOCK_M, layout=rows_layout)
        cols = col0 + gl.arange(0, BLOCK_N, layout=cols_layout)
        # a row's 1x128 scales start in its shard's block ([G, K/128, M/G]); K step ks's are ks * M/G further on
        shard = rows // rows_per_scale
        sa_ptrs = sa_ptr + shard * (k_steps * rows_per_scale) + (rows - shard * rows_per_scale)
        sa_mask = rows < M
        sw_row_ptr = sw_ptr + (col0 // 128) * sw_ld   # BLOCK_N <= 128: one weight scale per K step

        for ks in gl.static_range(STAGES - 2):   # the ring's first stages (k_steps >= STAGES - 2)
            _issue_load(a_desc, w_desc, a_smem, w_smem, ready, src_row, col0, ks, loaded + ks, STAGES, BLOCK_K)
        loaded += STAGES - 2

        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        for ks in range(0, k_steps, 2):
            if ks + STAGES - 2 < k_steps:   # into the stage K step ks - 2 used (finished last iteration)
                _issue_load(a_desc, w_desc, a_smem, w_smem, ready, src_row, col0, ks + STAGES - 2, loaded, STAGES,
                            BLOCK_K)
                loaded += 1
            if ks + STAGES - 1 < k_steps:   # into the stage K step ks - 1 used (finished last iteration)
                _issue_load(a_desc, w_desc, a_smem, w_smem, ready, src_row, col0, ks + STAGES - 1, loaded, STAGES,
                            BLOCK_K)
                loaded += 1
            first = consumed % STAGES
            mbarrier.wait(ready.index(first), (consumed // STAGES) & 1)
            x = warpgroup_mma(a_smem.index(first), w_smem.index(first).permute((1, 0)),
                              gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma), use_acc=False, is_async=True)
            second = (consumed + 1) % STAGES
            mbarrier.wait(ready.index(second), ((consumed + 1) // STAGES) & 1)
            y = warpgroup_mma(a_smem.index(second), w_smem.index(second).permute((1, 0)),
                              gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma), use_acc=False, is_async=True)
            consumed += 2
            x_scale = gl.load(sa_ptrs + ks * rows_per_scale, mask=sa_mask, other=0.0) * gl.load(sw_row_ptr + ks)
            y_scale = (gl.load(sa_ptrs + (ks + 1) * rows_per_scale, mask=sa_mask, other=0.0)
                       * gl.load(sw_row_ptr + ks + 1))
            x = warpgroup_mma_wait(num_outstanding=1, deps=(x, ))
            acc += x * x_scale[:, None]     # while y's MMAs run
            y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
            acc += y * y_scale[:, None]

        # the epilogue of kernels/signaled_gemm.py's store_tile_then_signal
        if HAS_BIAS:
            bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
            owns = (rows >= bias_row_lo) & (rows < bias_row_hi)
            acc += gl.where(owns[:, None], bias[None, :], 0.0)
        dst_col = gl.multiple_of(dst_col, BLOCK_N)
        out_rows = (dst_row + gl.arange(0, BLOCK_M, layout=rows_layout)).to(gl.int64)
        out_cols = dst_col + gl.arange(0, BLOCK_N, layout=cols_layout)
        gl.store(dst_base + out_rows[:, None] * ld_dst + out_cols[None, :], acc.to(dst_ptr.dtype.element_ty),
                 mask=(rows < src_row_end)[:, None] & (cols < N)[None, :])
        if SIGNAL:
            group = _cta_barrier_then(group)   # every thread's stores before the release
            gl.atomic_add(counters_ptr + group, 1, sem="release", scope="gpu")

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@aggregate
class _WsArgs:
    """What the warp-specialised kernel's partitions share: blockwise_gluon_kernel's arguments, and the ring."""
    a_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    a_smem: gl.shared_memory_descriptor
    w_smem: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor   # per stage: its loads landed
    empty: gl.shared_memory_descriptor   # per stage: both consumers' MMAs on it finished
    dst_ptr: gl.tensor
    ld_dst: gl.tensor
    dst_offsets_ptr: gl.tensor
    bias_ptr: gl.tensor
    bias_row_lo: gl.tensor
    bias_row_hi: gl.tensor
    tiles_ptr: gl.tensor
    num_tiles: gl.tensor
    counters_ptr: gl.tensor
    flags_ptr: gl.tensor
    wait_target: gl.tensor
    sa_ptr: gl.tensor
    rows_per_scale: gl.tensor
    sw_ptr: gl.tensor
    sw_ld: gl.tensor
    M: gl.tensor
    N: gl.tensor
    K: gl.tensor
    HAS_BIAS: gl.constexpr
    SIGNAL: gl.constexpr
    WAIT: gl.constexpr
    TILE_FIELDS: gl.constexpr
    NUM_PROGRAMS: gl.constexpr
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a_desc, w_desc, a_smem, w_smem, ready, empty, dst_ptr, ld_dst, dst_offsets_ptr, bias_ptr,
                 bias_row_lo, bias_row_hi, tiles_ptr, num_tiles, counters_ptr, flags_ptr, wait_target, sa_ptr,
                 rows_per_scale, sw_ptr, sw_ld, M, N, K, HAS_BIAS, SIGNAL, WAIT, TILE_FIELDS, NUM_PROGRAMS, STAGES):
        self.a_desc, self.w_desc, self.a_smem, self.w_smem = a_desc, w_desc, a_smem, w_smem
        self.ready, self.empty, self.dst_ptr, self.ld_dst = ready, empty, dst_ptr, ld_dst
        self.dst_offsets_ptr, self.bias_ptr, self.bias_row_lo, self.bias_row_hi = (dst_offsets_ptr, bias_ptr,
                                                                                  bias_row_lo, bias_row_hi)
        self.tiles_ptr, self.num_tiles, self.counters_ptr = tiles_ptr, num_tiles, counters_ptr
        self.flags_ptr, self.wait_target = flags_ptr, wait_target
        self.sa_ptr, self.rows_per_scale, self.sw_ptr, self.sw_ld = sa_ptr, rows_per_scale, sw_ptr, sw_ld
        self.M, self.N, self.K = M, N, K
        for name, value in (("HAS_BIAS", HAS_BIAS), ("SIGNAL", SIGNAL), ("WAIT", WAIT), ("TILE_FIELDS", TILE_FIELDS),
                            ("NUM_PROGRAMS", NUM_PROGRAMS), ("STAGES", STAGES)):
            setattr(self, name, gl.constexpr(value))


@gluon.jit
def _consumers_barrier_then(value):
    """bar.sync on named barrier 8 across the two consumer warpgroups (256 threads), then `value`: the warp-specialised
    kernel's CTA barrier before its signal (the partitions' own barriers are 0 to 2)."""
    return gl.inline_asm_elementwise("bar.sync 8, 256;\n\tmov.u32 $0, $1;", "=r,r", [value], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _ws_load_step(p, j, k_steps):
    """Load the program's j-th K step (its tile j // k_steps, K step j % k_steps) into stage j % STAGES once both
    consumers finished the step that used it last (a fresh barrier's phase 1 counts as finished)."""
    BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
    entry = p.tiles_ptr + (gl.program_id(0) + (j // k_steps) * p.NUM_PROGRAMS) * p.TILE_FIELDS
    ks = j % k_steps
    src_row = gl.load(entry + 0)
    if p.WAIT:
        if ks == 0:
            flag = gl.load(entry + 7)
            if flag >= 0:   # the tile's rows have arrived once flags[flag] reaches the call's target (cyclic)
                while _load_acquire(p.flags_ptr + flag) - p.wait_target < 0:
                    pass
                src_row = _fence_async_proxy_then(src_row)   # the TMA loads below are addressed after the fence
    s = j % p.STAGES
    mbarrier.wait(p.empty.index(s), ((j // p.STAGES) & 1) ^ 1)
    bar = p.ready.index(s)
    mbarrier.expect(bar, p.a_desc.block_type.nbytes + p.w_desc.block_type.nbytes)
    _tma_load(p.a_desc, [src_row, ks * BLOCK_K], bar, p.a_smem.index(s))
    _tma_load(p.w_desc, [gl.load(entry + 2), ks * BLOCK_K], bar, p.w_smem.index(s))


@gluon.jit
def _ws_consume(p, WG: gl.constexpr):
    """One warpgroup: rows [64 WG, 64 WG + 64) of each 128 x 256 tile, in two 128-column halves, each half's K-step
    product promoted while the other warpgroup's MMAs run (a warpgroup holds its 64 x 256 accumulator and one
    64 x 128 product: 192 fp32 registers a thread). Warpgroup 0 also issues the loads, STAGES - 1 K steps ahead."""
    BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
    HALF: gl.constexpr = p.w_desc.block_type.shape[0] // 2
    ROWS: gl.constexpr = p.a_desc.block_type.shape[0] // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)
    k_steps = p.K // BLOCK_K
    steps = gl.cdiv(p.num_tiles - gl.program_id(0), p.NUM_PROGRAMS) * k_steps   # this program's K steps, all tiles
    if WG == 0:
        for j in range(gl.minimum(p.STAGES - 1, steps)):
            _ws_load_step(p, j, k_steps)
    i = 0
    for e in range(gl.program_id(0), p.num_tiles, p.NUM_PROGRAMS):
        entry = p.tiles_ptr + e * p.TILE_FIELDS
        src_row = gl.load(entry + 0)
        src_row_end = gl.load(entry + 1)
        col0 = gl.multiple_of(gl.load(entry + 2), 2 * HALF)
        dst_row = gl.load(entry + 3)
        dst_col = gl.multiple_of(gl.load(entry + 4), 2 * HALF)
        group = gl.load(entry + 5)
        dst_base = p.dst_ptr + gl.multiple_of(gl.load(p.dst_offsets_ptr + gl.load(entry + 6)), 16)
        rows = src_row + WG * ROWS + gl.arange(0, ROWS, layout=rows_layout)
        shard = rows // p.rows_per_scale
        sa_ptrs = p.sa_ptr + shard * (k_steps * p.rows_per_scale) + (rows - shard * p.rows_per_scale)
        sa_mask = rows < p.M
        sw_left = p.sw_ptr + (col0 // 128) * p.sw_ld       # a 128-column half lies in one 128x128 weight block
        right_in = col0 + HALF < p.N
        acc_left = gl.zeros((ROWS, HALF), dtype=gl.float32, layout=mma)
        acc_right = gl.zeros((ROWS, HALF), dtype=gl.float32, layout=mma)
        for ks in range(k_steps):
            if WG == 0:
                if i + p.STAGES - 1 < steps:   # into the stage step i - 1 used
                    _ws_load_step(p, i + p.STAGES - 1, k_steps)
            s = i % p.STAGES
            mbarrier.wait(p.ready.index(s), (i // p.STAGES) & 1)
            a_rows = p.a_smem.index(s).slice(WG * ROWS, ROWS)
            w_stage = p.w_smem.index(s)
            x = warpgroup_mma(a_rows, w_stage.slice(0, HALF).permute((1, 0)),
                              gl.zeros((ROWS, HALF), dtype=gl.float32, layout=mma), use_acc=False, is_async=True)
            sa = gl.load(sa_ptrs + ks * p.rows_per_scale, mask=sa_mask, other=0.0)
            left_scale = sa * gl.load(sw_left + ks)
            right_scale = sa * gl.load(sw_left + p.sw_ld + ks, mask=right_in, other=0.0)
            x = warpgroup_mma_wait(num_outstanding=0, deps=(x, ))
            acc_left += x * left_scale[:, None]
            y = warpgroup_mma(a_rows, w_stage.slice(HALF, HALF).permute((1, 0)),
                              gl.zeros((ROWS, HALF), dtype=gl.float32, layout=mma), use_acc=False, is_async=True)
            y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
            mbarrier.arrive(p.empty.index(s), count=1)   # this warpgroup's MMAs on stage s are done
            acc_right += y * right_scale[:, None]
            i += 1
        # the epilogue of kernels/signaled_gemm.py's store_tile_then_signal, each warpgroup its rows
        cols = col0 + gl.arange(0, HALF, layout=cols_layout)
        if p.HAS_BIAS:
            owns = ((rows >= p.bias_row_lo) & (rows < p.bias_row_hi))[:, None]
            acc_left += gl.where(owns, gl.load(p.bias_ptr + cols, mask=cols < p.N, other=0.0).to(gl.float32)[None, :],
                                 0.0)
            acc_right += gl.where(owns, gl.load(p.bias_ptr + cols + HALF, mask=cols + HALF < p.N,
                                                other=0.0).to(gl.float32)[None, :], 0.0)
        out_rows = (dst_row + WG * ROWS + gl.arange(0, ROWS, layout=rows_layout)).to(gl.int64)
        out_cols = dst_col + gl.arange(0, HALF, layout=cols_layout)
        out = dst_base + out_rows[:, None] * p.ld_dst + out_cols[None, :]
        keep = rows < src_row_end
        gl.store(out, acc_left.to(p.dst_ptr.dtype.element_ty), mask=keep[:, None] & (cols < p.N)[None, :])
        gl.store(out + HALF, acc_right.to(p.dst_ptr.dtype.element_ty),
                 mask=keep[:, None] & (cols + HALF < p.N)[None, :])
        if p.SIGNAL:
            group = _consumers_barrier_then(group)   # both warpgroups' stores before the release
            if WG == 0:
                gl.atomic_add(p.counters_ptr + group, 1, sem="release", scope="gpu")


@gluon.jit
def _ws_consumer0(p):
    _ws_consume(p, 0)


@gluon.jit
def _ws_consumer1(p):
    _ws_consume(p, 1)


@gluon.jit
def blockwise_ws_kernel(a_desc, w_desc, dst_ptr, ld_dst, dst_offsets_ptr, bias_ptr, bias_row_lo, bias_row_hi,
                        tiles_ptr, num_tiles, counters_ptr, flags_ptr, wait_target,
                        sa_ptr, rows_per_scale, sw_ptr, sw_ld, M, N, K,
                        HAS_BIAS: gl.constexpr, SIGNAL: gl.constexpr, WAIT: gl.constexpr,
                        TILE_FIELDS: gl.constexpr, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """128 x 256 tiles (BLOCK_M 128, BLOCK_N 256, BLOCK_K 128) on two consumer warpgroups, each its own partition
    (gl.warp_specialize) so that no CTA barrier ties them: each multiplies and promotes its 64 rows, and the tensor
    cores run one warpgroup's MMAs while the other promotes, as in DeepGEMM's Hopper kernel. Warpgroup 0 also fills
    the ring (mbarriers ready / empty per stage; a separate producer warp would round the CTA up to 12 warps, whose
    registers ptxas then caps at 168 a thread, so the consumers spill). The tile's L2 traffic per flop is half a
    64x128 tile's. The epilogue is the library's: each warpgroup's bias and stores, a barrier of both warpgroups,
    then one release signal; warpgroup 0 spins on a tile's ready flag (acquire, then the async-proxy fence) before
    loading its first K step. The ring's protocol is checked in random interleavings by
    tests/bench/test_fp8_blockwise_ws_ring.py."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    p = _WsArgs(a_desc, w_desc, a_smem, w_smem, ready, empty, dst_ptr, ld_dst, dst_offsets_ptr, bias_ptr, bias_row_lo,
                bias_row_hi, tiles_ptr, num_tiles, counters_ptr, flags_ptr, wait_target, sa_ptr, rows_per_scale, sw_ptr,
                sw_ld, M, N, K, HAS_BIAS, SIGNAL, WAIT, TILE_FIELDS, NUM_PROGRAMS, STAGES)
    gl.warp_specialize([(_ws_consumer0, (p, )), (_ws_consumer1, (p, ))], [4], [CONSUMER_REGS])


WS_MAXNREG = 256      # 8 warps (2 warpgroups) x 32 x 256 = 64K registers: no producer partition to feed
WS_CONSUMER_REGS = 256


def _descriptors(a, w, bm, bn, bk):
    """TMA descriptors of the FP8 operands a [M, K] in [bm, bk] boxes and w [N, K] in [bn, bk] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    def descriptor(q, rows):
        return TensorDescriptor(q, list(q.shape), list(q.stride()), [rows, bk],
                                gl.NVMMASharedLayout.get_default_for([rows, bk], gl.float8e4nv))
    return descriptor(a.q, bm), descriptor(w.q, bn)


def _bind(kernel, options, a, w, dst, tile, num_programs, tiles, counters, flags, wait_target, bias, bias_rows,
          dst_offsets):
    """A callable launching `kernel` (blockwise_gluon_kernel's arguments) with launch `options`."""
    from overlap_tp.kernels.fp8_gemm import check_scaled_operands
    from overlap_tp.kernels.fp8_quant import shard_count
    from overlap_tp.kernels.signaled_gemm import TILE_FIELDS, default_offsets
    check_scaled_operands(a, w, bias)
    bm, bn, bk, stages, _ = tile
    (m, k), n = a.q.shape, w.q.shape[0]
    a_desc, w_desc = _descriptors(a, w, bm, bn, bk)
    num_tiles = tiles.shape[0]
    grid = (max(1, min(num_programs, num_tiles)),)
    offsets = dst_offsets if dst_offsets is not None else default_offsets(dst.device)

    def call():
        kernel[grid](a_desc, w_desc, dst, dst.stride(0), offsets, bias if bias is not None else dst, bias_rows[0],
                     bias_rows[1], tiles, num_tiles, counters if counters is not None else tiles,
                     flags if flags is not None else tiles, wait_target, a.ds, m // shard_count(a), w.ds,
                     w.ds.shape[1], m, n, k, HAS_BIAS=bias is not None, SIGNAL=counters is not None,
                     WAIT=flags is not None, TILE_FIELDS=TILE_FIELDS, NUM_PROGRAMS=grid[0], STAGES=stages, **options)
    return call


def launch(a, w, dst, tile, num_programs, tiles, *, counters=None, flags=None, wait_target=0, bias=None,
           bias_rows=(0, 0), dst_offsets=None):
    """A callable running blockwise_gluon_kernel on ScaledFp8 a (1x128, or a gathered a's G shards) and w (128x128)
    over `tiles` (an expanded plan table on the GPU, kernels/signaled_gemm.py's fields) into dst, raising `counters`
    and waiting on `flags` as kernels/fp8_gemm.py's fp8_signaled_gemm does; tile is (BLOCK_M, BLOCK_N, BLOCK_K,
    STAGES, num_warps) with BLOCK_K 128, BLOCK_N dividing 128, BLOCK_M = 16 * num_warps, STAGES >= 3; K a multiple
    of 256 with K / 128 >= STAGES - 2."""
    bm, bn, bk, stages, warps = tile
    k = a.q.shape[1]
    if ((a.scaling, w.scaling) != ("1x128", "128x128") or bk != 128 or 128 % bn or bm != 16 * warps
            or k % (2 * bk) or k // bk < stages - 2 or stages < 3):
        raise ValueError(f"gluon does not take {a.scaling} x {w.scaling}, tile {bm}x{bn}x{bk}/{stages}/{warps} "
                         f"at K={k}")
    return _bind(blockwise_gluon_kernel, dict(num_warps=warps), a, w, dst, tile, num_programs, tiles, counters,
                 flags, wait_target, bias, bias_rows, dst_offsets)


def launch_ws(a, w, dst, tile, num_programs, tiles, *, counters=None, flags=None, wait_target=0, bias=None,
              bias_rows=(0, 0), dst_offsets=None):
    """launch's contract for blockwise_ws_kernel: tile (128, 256, 128, STAGES, 4), the 4 warps being the first
    consumer's (the CTA has 8); K a multiple of 128, STAGES >= 2."""
    bm, bn, bk, stages, warps = tile
    k = a.q.shape[1]
    if ((a.scaling, w.scaling) != ("1x128", "128x128") or (bm, bn, bk, warps) != (128, 256, 128, 4) or k % bk
            or stages < 2):
        raise ValueError(f"gluon-ws does not take {a.scaling} x {w.scaling}, tile {bm}x{bn}x{bk}/{stages}/{warps} "
                         f"at K={k}")
    return _bind(blockwise_ws_kernel, dict(CONSUMER_REGS=WS_CONSUMER_REGS, num_warps=4, maxnreg=WS_MAXNREG), a, w,
                 dst, tile, num_programs, tiles, counters, flags, wait_target, bias, bias_rows, dst_offsets)


def _compile_sm90(kernel, signature, constexprs, aligned, options):
    """`kernel` compiled for sm_90 without a GPU (Triton's CompiledKernel: .asm holds ttgir, ptx, cubin), with the
    16-divisibility Triton's launcher finds in `aligned` at the layers' shapes. A TensorDescriptor argument's
    signature is "desc:ROWS": tensordesc<fp8e4nv[ROWS, 128],layout>."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)
        return f"tensordesc<fp8e4nv[{rows}, 128],{layout!r}>"
    signature = {name: desc(int(kind[5:])) if kind.startswith("desc:") else kind for name, kind in signature.items()}
    names = list(signature)
    src = GluonASTSource(kernel, signature,
                         constexprs={(names.index(name),): value for name, value in constexprs.items()},
                         attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


# blockwise_gluon_kernel's and blockwise_ws_kernel's arguments before their constexprs, and those aligned (the
# 16-divisibility Triton's launcher finds at the layers' shapes)
_SIGNATURE = {"dst_ptr": "*bf16", "ld_dst": "i32", "dst_offsets_ptr": "*i64", "bias_ptr": "*bf16", "bias_row_lo": "i32",
              "bias_row_hi": "i32", "tiles_ptr": "*i32", "num_tiles": "i32", "counters_ptr": "*i32",
              "flags_ptr": "*i32", "wait_target": "i32", "sa_ptr": "*fp32", "rows_per_scale": "i32", "sw_ptr": "*fp32",
              "sw_ld": "i32", "M": "i32", "N": "i32", "K": "i32"}
_ALIGNED = ("dst_ptr", "dst_offsets_ptr", "bias_ptr", "tiles_ptr", "counters_ptr", "flags_ptr", "sa_ptr", "sw_ptr",
            "ld_dst", "M", "N", "K")


def compile_sm90(block_m=64, block_n=128, stages=4, num_warps=4, signal=True, wait=True, bias=True):
    """blockwise_gluon_kernel compiled for sm_90 without a GPU (the CPU test reads its SASS)."""
    constexprs = {"HAS_BIAS": bias, "SIGNAL": signal, "WAIT": wait, "TILE_FIELDS": 9, "NUM_PROGRAMS": 132,
                  "STAGES": stages, "num_warps": num_warps}
    signature = {"a_desc": f"desc:{block_m}", "w_desc": f"desc:{block_n}", **_SIGNATURE,
                 **{name: "constexpr" for name in constexprs}}
    return _compile_sm90(blockwise_gluon_kernel, signature, constexprs, _ALIGNED, {"num_warps": num_warps})


def compile_ws_sm90(stages=4, signal=True, wait=True, bias=True):
    """blockwise_ws_kernel compiled for sm_90 without a GPU (the CPU test reads its SASS and registers)."""
    constexprs = {"HAS_BIAS": bias, "SIGNAL": signal, "WAIT": wait, "TILE_FIELDS": 9, "NUM_PROGRAMS": 132,
                  "STAGES": stages, "CONSUMER_REGS": WS_CONSUMER_REGS, "num_warps": 4}
    signature = {"a_desc": "desc:128", "w_desc": "desc:256", **_SIGNATURE, **{name: "constexpr" for name in constexprs}}
    return _compile_sm90(blockwise_ws_kernel, signature, constexprs, _ALIGNED, {"num_warps": 4, "maxnreg": WS_MAXNREG})
