"""Persistent Triton GEMM that signals per group of tiles: C = A @ W.T, W in nn.Linear layout.

The main loop is the plain TMA-fed K loop of a persistent GEMM. Only two things differ from a
textbook kernel: the tile order comes from a plan table (overlap_tp/ops/tile_plan.py), and the epilogue, after
storing a tile, raises its group's counter with a release atomic so the comm stream (or the next
kernel) can start on a group as soon as its last tile is visible.

Ordering argument for the signal: every thread stores its part of the tile with ordinary st.global;
a CTA barrier (bar.sync) orders those stores before the atomic in CTA scope; the atomic is a
gpu-scope release, which is cumulative, so whoever observes the counter (acquire, or a stream
wait-value that precedes a kernel launch) observes the whole tile. FlashOverlap's epilogue lacks the
barrier: a fast warp could signal before a slow warp's stores land. The barrier is inline PTX rather
than `tl.debug_barrier()`, because Triton 3.6 refuses to software-pipeline a flattened persistent loop
that contains the latter (the TTGIR then holds one shared-memory stage instead of `num_stages`, and
the kernel runs at a fraction of cuBLAS's speed).

Counters count one call's tiles: each call raises counter g from 0 to group_tiles[g], and the waiter writes
0 back after its wait (overlap_tp/ops/comm.py), so every call and every CUDA graph replay waits for the same
fixed target and no memset sits on the critical path.

AllGather+GEMM runs the same kernel the other way round (WAIT, no SIGNAL): a tile whose WAIT field
names a ready flag spins on it before its first load, with acquire loads, until the flag reaches this
call's value (1; compared cyclically); the comm stream raises the flag with cuStreamWriteValue32 once the
chunk's transfer completed. The TMA loads that follow read through the async proxy, so a
`fence.proxy.async` orders them after the acquire.

Grouped expert GEMMs (overlap_tp/ops/expert.py) run it over L weights W[L, N, K] seen as one [L*N, K]
matrix: a tile's EXPERT field l puts its W box at row l*N + col. A box that overhangs into expert l+1
(N % BLOCK_N != 0) only feeds columns >= N, which the store masks out.

Backward GEMMs multiply by the weight itself, not its transpose (dgrad = dY @ W): the launcher takes
`w` as the transposed *view* of a row-major [K, N] (or [L, K, N]) tensor and the kernel reads that
tensor in place (W_KN: [BLOCK_K, BLOCK_N] boxes at row l*K + k), so no transposed copy of the weight
is made per backward.
"""
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from overlap_tp.kernels.direct_launch import INTERPRET, DirectKernel


# The plan table (built by overlap_tp/ops/tile_plan.py), one row per tile in execution order: source rows
# [src_row, src_row_end) (the end stops a tile at its region's boundary), source/destination column,
# destination row/column in the staging matrix, group, the destination buffer (0 = local staging; the
# p2p plan stores region k's tiles into rank k's buffer), the ready flag the tile waits for before
# loading A (-1: none; AllGather+GEMM plans only), and the expert whose weight the tile multiplies, of
# the L stacked in W (grouped expert GEMMs, overlap_tp/ops/moe_tile_plan.py; 0 in every single-weight plan).
SRC_ROW, SRC_ROW_END, COL, DST_ROW, DST_COL, GROUP, DST_BUF, WAIT, EXPERT = range(9)
TILE_FIELDS = 9
NO_WAIT = -1
# The least group search the kernel unrolls for row tiles (RowTiles.max_groups): 16 masked loads of the group starts
# per tile, beside a tile's K-loop of TMA loads.
ROW_TILE_GROUPS = 16



@dataclass(frozen=True)
class RowTiles:
    """A tile table in row-tile form (the kernel's ROW_TILES mode): one table row per row tile (COL and DST_COL
    unused), in groups: group g holds row tiles [starts[g], starts[g+1]). Every row tile has n_tiles = ceil(N /
    BLOCK_N) tiles, so group g's tiles are tiles [starts[g] * n_tiles, starts[g+1] * n_tiles) of the execution
    order, and within the group they run in raster order: runs of raster_m row tiles, the N-tile outer and the
    row tile inner within a run (expanded() writes the table the kernel walks). The grouped expert GEMMs build
    one per routing, on the host, while the GPU waits for it: a few hundred rows, where the expanded table has
    one per tile (22,960 rows, 0.8 MB, at Mixtral's fc1 with 8192 tokens per rank at EP 2)."""
    rows: torch.Tensor     # int32 [R, TILE_FIELDS]
    starts: torch.Tensor   # int32 [G + 1], non-decreasing, starts[0] = 0, starts[G] = R
    n_tiles: int
    raster_m: int

    @property
    def num_groups(self) -> int:
        return self.starts.shape[0] - 1

    @property
    def num_tiles(self) -> int:
        return self.rows.shape[0] * self.n_tiles

    @property
    def max_groups(self) -> int:
        """The kernel's unrolled group search: a power of two >= the groups and >= ROW_TILE_GROUPS, so the group
        counts of every routing (1 + parts, up to 9 with groups='auto') share one compiled kernel."""
        return 1 << max(1, (max(self.num_groups, ROW_TILE_GROUPS) - 1).bit_length())

    def group_tiles(self):
        """Tiles per group."""
        starts = self.starts.tolist()
        return [(b - a) * self.n_tiles for a, b in zip(starts, starts[1:])]

    def to(self, copy) -> "RowTiles":
        """The same table through `copy` (a host tensor -> device tensor function), rows and starts in one copy (the
        expert ops copy a table per routing, on the host's critical path): starts 16-byte aligned after the rows."""
        rows = self.rows.reshape(-1)
        pad = -rows.numel() % 4
        both = copy(torch.cat((rows, rows.new_zeros(pad), self.starts)))
        end = rows.numel()
        return RowTiles(both[:end].view(self.rows.shape), both[end + pad:], self.n_tiles, self.raster_m)

    def expanded(self, block_n: int) -> torch.Tensor:
        """The table the kernel walks, one row per tile in execution order (the host reference of ROW_TILES)."""
        rows, starts = self.rows.cpu().numpy(), self.starts.tolist()
        parts = []
        for lo, hi in zip(starts, starts[1:]):
            i = np.arange((hi - lo) * self.n_tiles)
            run = i // (self.raster_m * self.n_tiles) * self.raster_m
            run_rows = np.minimum(hi - lo - run, self.raster_m)
            within = i - run * self.n_tiles
            tiles = rows[lo + run + within % np.maximum(run_rows, 1)].copy()
            tiles[:, COL] = tiles[:, DST_COL] = within // np.maximum(run_rows, 1) * block_n
            parts.append(tiles)
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros((0, TILE_FIELDS), np.int32))


# Under the CPU interpreter (INTERPRET, kernels/direct_launch.py) the kernel upcasts its dot operands (the interpreter's
# tl.dot mishandles bf16/fp16; the upcast is exact, a product of two bf16 values is exact in fp32) and uses
# tl.debug_barrier (it has no inline PTX). The compiled GPU kernel is untouched by either.


@triton.jit
def cta_barrier_then(value):
    """bar.sync across the CTA, then `value`: whatever uses the result cannot move above the barrier."""
    return tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, $1;", "=r,r", [value], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def load_acquire(ptr):
    """ld.acquire.gpu of one int32 word (the same word in every thread)."""
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def fence_async_proxy_then(value):
    """fence.proxy.async, then `value`: TMA (async proxy) loads addressed with the result are issued
    after the fence and see what the preceding acquire made visible."""
    return tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r", [value],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_flag_then(flags_ptr, flag, target, value, INTERPRETED: tl.constexpr):
    """Spin until flags[flag] - target >= 0 (int32, cyclic compare), then `value`, which
    the caller uses to address its loads: they depend on the wait through the opaque asm and cannot
    be hoisted above it (by the compiler or the software pipeliner)."""
    if INTERPRETED:
        while tl.atomic_add(flags_ptr + flag, 0) - target < 0:
            pass
    else:
        while load_acquire(flags_ptr + flag) - target < 0:
            pass
        value = fence_async_proxy_then(value)
    return value


@triton.jit
def store_tile_then_signal(acc, rows, cols, src_row_end, N, dst_base, ld_dst, dst_row, dst_col,
                           bias_ptr, bias_row_lo, bias_row_hi, counters_ptr, group,
                           HAS_BIAS: tl.constexpr, SIGNAL: tl.constexpr, INTERPRETED: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's epilogue, shared by the signaled GEMMs (this one and fp8_gemm.py's): the bias on the rows
    [bias_row_lo, bias_row_hi) that own it, the fp32 accumulator `acc` (source rows `rows`, columns `cols`; rows from
    src_row_end on and columns from N on masked) stored at (dst_row, dst_col) of dst_base in its element type, then,
    with SIGNAL, group `group`'s counter raised with release semantics after a CTA barrier: every thread's stores
    come before the signal (the memory-ordering argument of the module docstring)."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        owns = (rows >= bias_row_lo) & (rows < bias_row_hi)
        acc += tl.where(owns[:, None], bias[None, :], 0.0)
    mask = (rows < src_row_end)[:, None] & (cols < N)[None, :]
    out_rows = (dst_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    out_cols = dst_col + tl.arange(0, BLOCK_N)
    tl.store(dst_base + out_rows[:, None] * ld_dst + out_cols[None, :], acc.to(dst_base.dtype.element_ty),
             mask=mask)
    if SIGNAL:
        if INTERPRETED:
            tl.debug_barrier()
        else:
            group = cta_barrier_then(group)
        tl.atomic_add(counters_ptr + group, 1, sem="release", scope="gpu")


# The integers a routing changes (the expert ops build a plan per routing, every step) are not specialized: Triton
# would compile a new variant whenever one of them became 1 or a multiple of 16, a compile of a large fraction of a
# second inside the step of the routing that first did (a Zipf routing's first step, in every expert-op variant).
ROUTING_INTS = ("bias_row_lo", "bias_row_hi", "num_tiles", "num_groups", "wait_target")


@triton.jit(do_not_specialize=ROUTING_INTS)
def signaled_gemm_kernel(
    a_desc, w_desc,                 # TMA descriptors: A [M, K] in [BLOCK_M, BLOCK_K] boxes, W [L*N, K]
    dst_ptr, ld_dst,                # staging matrix the tiles are stored into, its row stride
    dst_offsets_ptr,                # int64 per destination buffer: its element offset from dst_ptr
    bias_ptr, bias_row_lo, bias_row_hi,   # bias added to source rows [lo, hi) only
    tiles_ptr, num_tiles,           # plan table: int32 [num_tiles, TILE_FIELDS] in execution order (ROW_TILES:
                                    # one row per row tile, see below), and the number of tiles
    bounds_ptr, num_groups,         # ROW_TILES: int32 [num_groups + 1], each group's first row tile (and the end)
    counters_ptr,                   # SIGNAL: int32 per group, raised once per stored tile
    flags_ptr, wait_target,         # WAIT: int32 ready flags and the value they are raised to
    N, K,                           # N: the output columns of one weight (one expert)
    HAS_BIAS: tl.constexpr, SIGNAL: tl.constexpr, WAIT: tl.constexpr, INTERPRETED: tl.constexpr,
    W_KN: tl.constexpr,             # w_desc holds W row-major as [L*K, N] (C = A @ W), not [L*N, K]
    TILE_FIELDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    ROW_TILES: tl.constexpr,        # the table holds row tiles; tiles are (row tile, N-tile) pairs, rastered
    RASTER_M: tl.constexpr,         # in runs of RASTER_M row tiles within each group (expand_row_tiles)
    MAX_GROUPS: tl.constexpr,       # ROW_TILES: a power of two >= num_groups
):
    k_steps = tl.cdiv(K, BLOCK_K)
    for e in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        if ROW_TILES:
            # every row tile has n_tiles tiles, so tile e lies in the group whose row tiles hold row tile
            # e // n_tiles: g = the number of later groups starting at or before it (starts never decrease)
            n_tiles = tl.cdiv(N, BLOCK_N)
            g = 0
            for j in tl.static_range(1, MAX_GROUPS):
                start = tl.load(bounds_ptr + j, mask=j < num_groups, other=num_tiles)
                g += (start <= e // n_tiles).to(tl.int32)
            first_row = tl.load(bounds_ptr + g)
            m_tiles = tl.load(bounds_ptr + g + 1) - first_row
            i = e - first_row * n_tiles
            # the group's i-th tile in raster order: runs of RASTER_M row tiles, N-tiles outer, rows inner
            run = i // (RASTER_M * n_tiles) * RASTER_M
            run_rows = tl.minimum(m_tiles - run, RASTER_M)
            within = i - run * n_tiles
            entry = tiles_ptr + (first_row + run + within % run_rows) * TILE_FIELDS
            col = within // run_rows * BLOCK_N
            dst_col = col
        else:
            entry = tiles_ptr + e * TILE_FIELDS
            col = tl.load(entry + 2)
            dst_col = tl.load(entry + 4)
        src_row = tl.load(entry + 0)
        src_row_end = tl.load(entry + 1)
        dst_row = tl.load(entry + 3)
        group = tl.load(entry + 5)
        # Other buffers (peers' receive buffers mapped into this GPU's address space) are addressed as
        # offsets from dst_ptr: one flat address space, no integer-to-pointer casts. Their owner
        # (overlap_tp/ops/p2p_reduction.py) checks that each offset is a multiple of 16 elements: 16-byte stores stay.
        dst_base = dst_ptr + tl.multiple_of(tl.load(dst_offsets_ptr + tl.load(entry + 6)), 16)
        expert = tl.load(entry + 8)

        if WAIT:
            flag = tl.load(entry + 7)
            if flag >= 0:
                src_row = wait_flag_then(flags_ptr, flag, wait_target, src_row, INTERPRETED)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([src_row, ks * BLOCK_K])
            if W_KN:
                w = w_desc.load([expert * K + ks * BLOCK_K, col])    # [BLOCK_K, BLOCK_N]
            else:
                w = w_desc.load([expert * N + col, ks * BLOCK_K])    # [BLOCK_N, BLOCK_K]
            if INTERPRETED:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if W_KN:
                acc = tl.dot(a, w, acc)
            else:
                acc = tl.dot(a, w.T, acc)

        col = tl.multiple_of(col, BLOCK_N)           # plans start tiles on block_n columns: lets the
        dst_col = tl.multiple_of(dst_col, BLOCK_N)   # compiler emit 16-byte stores
        rows = src_row + tl.arange(0, BLOCK_M)
        cols = col + tl.arange(0, BLOCK_N)
        store_tile_then_signal(acc, rows, cols, src_row_end, N, dst_base, ld_dst, dst_row, dst_col,
                               bias_ptr, bias_row_lo, bias_row_hi, counters_ptr, group,
                               HAS_BIAS, SIGNAL, INTERPRETED, BLOCK_M, BLOCK_N)


def weight_layout(w: torch.Tensor):
    """How the kernel reads w [..., N, K]: "nk" (row-major: nn.Linear's layout), "kn" (the transposed view
    of a row-major [..., K, N], e.g. `weight.t()` for a dgrad: read in place), or None (neither)."""
    if w.is_contiguous():
        return "nk"
    if w.transpose(-2, -1).is_contiguous():
        return "kn"
    return None


def check_operands(a: torch.Tensor, w: torch.Tensor, bias=None):
    """The kernel's input contract; a ValueError names the broken constraint."""
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"expected a[M, K] and w[N, K]; got a{tuple(a.shape)} and w{tuple(w.shape)}")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"inner dimensions differ: a{tuple(a.shape)} @ w{tuple(w.shape)}.T")
    if a.dtype not in (torch.bfloat16, torch.float16) or w.dtype != a.dtype:
        raise ValueError(f"a and w must both be bf16 or fp16; got {a.dtype} and {w.dtype}")
    if a.device != w.device:
        raise ValueError(f"a is on {a.device} but w is on {w.device}")
    if not a.is_contiguous():
        raise ValueError("a must be contiguous (row-major)")
    if weight_layout(w) is None:
        raise ValueError(f"w must be row-major [N, K] or the transposed view of a row-major [K, N] "
                         f"(weight.t()); got strides {w.stride()} for shape {tuple(w.shape)}")
    if bias is not None:
        if bias.shape != (w.shape[0],) or bias.device != a.device or not bias.is_contiguous():
            raise ValueError(f"bias must be a contiguous [{w.shape[0]}] tensor on {a.device}; "
                             f"got {tuple(bias.shape)} on {bias.device}")


def tma_unsupported_reason(a: torch.Tensor, w: torch.Tensor):
    """Why TMA descriptors cannot address a and w, or None."""
    if a.shape[1] % 8:
        return f"K={a.shape[1]} is not a multiple of 8 (TMA needs 16-byte row strides)"
    if weight_layout(w) == "kn" and w.shape[-2] % 8:
        return f"N={w.shape[-2]} is not a multiple of 8 (TMA reads the transposed weight's [K, N] rows)"
    if a.data_ptr() % 16 or w.data_ptr() % 16:
        return "a or w does not start on a 16-byte boundary (TMA)"
    return None


def _launch_args(a, w, dst, tiles, counters, num_programs, config, bias, bias_rows, dst_offsets, flags, wait_target):
    """(grid, the kernel's arguments in parameter order, the launch options) for Triton's JIT. tiles: an expanded
    table (a device int32 tensor) or a RowTiles on the device."""
    grid, rest, options = _plain_args(a, w, dst, tiles, counters, num_programs, config, bias, bias_rows, dst_offsets,
                                      flags, wait_target)
    return grid, _descriptors(a, w, config) + rest, options


def _descriptors(a, w, config):
    """The kernel's two TMA descriptors as Triton's JIT takes them: A in [BLOCK_M, BLOCK_K] boxes, and the
    weight's row-major storage as a matrix ([L*K, N] in [BLOCK_K, BLOCK_N] boxes for "kn", else [L*N, K])."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if weight_layout(w) == "kn":
        w_desc = TensorDescriptor.from_tensor(_kn_rows(w), [bk, bn])
    else:
        w_desc = TensorDescriptor.from_tensor(_nk_rows(w), [bn, bk])
    return TensorDescriptor.from_tensor(a, [bm, bk]), w_desc


def _plain_args(a, w, dst, tiles, counters, num_programs, config, bias, bias_rows, dst_offsets, flags, wait_target):
    """(grid, the kernel's arguments after its two descriptors in parameter order, the launch options): the one
    source of the argument order, for the JIT launch and the direct launch of SignaledGemm."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    n, k = w.shape[-2], a.shape[1]
    w_kn = weight_layout(w) == "kn"
    if w_kn and w.dim() == 3 and w.shape[0] > 1 and k % bk:
        raise ValueError(f"transposed expert weights need K={k} to be a multiple of block_k={bk} (a K tail box "
                         f"would read the next expert's rows)")
    if isinstance(tiles, RowTiles):
        assert tiles.n_tiles == -(-n // bn), (tiles.n_tiles, n, bn)
        row_tiles, tiles = tiles, tiles.rows
        num_tiles, bounds, num_groups = row_tiles.num_tiles, row_tiles.starts, row_tiles.num_groups
        raster_m, max_groups = row_tiles.raster_m, row_tiles.max_groups
    else:
        row_tiles = None
        num_tiles, bounds, num_groups, raster_m, max_groups = tiles.shape[0], tiles, 0, 1, 1
    assert tiles.shape[1] == TILE_FIELDS and tiles.dtype == torch.int32
    # row tiles come from routings: their grid (a constexpr) is the plan's programs whatever the tile count (programs
    # without a tile exit at once), so a routing with few tiles compiles no new variant
    grid = num_programs if row_tiles is not None else max(1, min(num_programs, num_tiles))
    args = (dst, dst.stride(0), dst_offsets if dst_offsets is not None else default_offsets(dst.device),
            bias if bias is not None else dst, bias_rows[0], bias_rows[1],
            tiles, num_tiles, bounds, num_groups, counters if counters is not None else tiles,
            flags if flags is not None else tiles, wait_target,
            n, k,
            # constexprs, in parameter order
            bias is not None, counters is not None, flags is not None, INTERPRET, w_kn, TILE_FIELDS,
            bm, bn, bk, grid, row_tiles is not None, raster_m, max_groups)
    return grid, args, dict(num_stages=config.num_stages, num_warps=config.num_warps)


_CONSTEXPRS = ("HAS_BIAS", "SIGNAL", "WAIT", "INTERPRETED", "W_KN", "TILE_FIELDS", "BLOCK_M", "BLOCK_N", "BLOCK_K",
               "NUM_PROGRAMS", "ROW_TILES", "RASTER_M", "MAX_GROUPS")
# the names of the kernel's plain parameters, between its two descriptors and its constexprs, as the kernel declares them
_PLAIN = tuple(signaled_gemm_kernel.arg_names[2:len(signaled_gemm_kernel.arg_names) - len(_CONSTEXPRS)])


def _jit_launch(grid, args, options):
    """Through Triton's JIT (compiles on the first call of a specialization); returns the compiled kernel."""
    positional = args[:-len(_CONSTEXPRS)]
    constexprs = dict(zip(_CONSTEXPRS, args[-len(_CONSTEXPRS):]))
    return signaled_gemm_kernel[(grid,)](*positional, **constexprs, **options)


_default_offsets = {}


def default_offsets(device):
    """The offset table of plans that store everything into dst itself (one per device; plans make it when
    they are built, so no call under graph capture allocates it)."""
    if device not in _default_offsets:
        _default_offsets[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return _default_offsets[device]


def signaled_gemm(a, w, dst, tiles, counters, num_programs, config, bias=None, bias_rows=(0, 0), dst_offsets=None,
                  flags=None, wait_target=0):
    """Launch the kernel: the tiles of `tiles` (device int32 table, or a RowTiles on the device) into `dst` (or,
    for a tile whose DST_BUF is b, into the buffer `dst_offsets[b]` elements away from dst), raising `counters` (unless
    None); with `flags`, a tile whose WAIT field is f >= 0 first waits until flags[f] reaches wait_target.
    `w` is one weight [N, K] or L expert weights [L, N, K] that the tiles pick by their EXPERT field, either
    row-major or the transposed view of a row-major [L, K, N] (weight_layout "kn", read in place).
    Through Triton's JIT dispatch; the ops' plans launch through SignaledGemm instead."""
    _jit_launch(*_launch_args(a, w, dst, tiles, counters, num_programs, config, bias, bias_rows, dst_offsets, flags,
                              wait_target))


class SignaledGemm:
    """The signaled GEMM of one plan, launched without Triton's launch path (kernels/direct_launch.py).

    Triton's JIT binds and specializes every argument and looks the kernel up by that key on every call (tens of
    microseconds of host time per launch), and its launcher re-encodes both TMA
    descriptors per launch. A plan's launches differ only in their tensors, so this keeps, per variant (bias or not,
    weight layout, the destination's 16-byte alignment and row stride: what Triton specializes on that a call can
    change), the compiled kernel as a DirectKernel and the launcher's arguments with every plan-owned tensor already
    a pointer; a launch fills in a, w, dst and bias (descriptors from the kernel's cache) and calls the C launcher.
    The first launch of a variant looks the compiled kernel up by its arguments' specialization (specialization_key,
    shared by every SignaledGemm), or goes through the JIT, which compiles it. Under the CPU interpreter every
    launch goes through the JIT (there is no compiled kernel)."""

    def __init__(self, tiles, num_programs, config, *, counters=None, bias_rows=(0, 0), dst_offsets=None, flags=None,
                 wait_target=0):
        self.tiles, self.num_programs, self.config = tiles, num_programs, config
        self.counters, self.bias_rows, self.dst_offsets = counters, bias_rows, dst_offsets
        self.flags, self.wait_target = flags, wait_target
        self.device_index = (tiles.rows if isinstance(tiles, RowTiles) else tiles).device.index
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        self._boxes = ([bm, bk], [bk, bn], [bn, bk])   # a; w read as [.., K, N] ("kn"); w as [.., N, K]
        self._variants = {}
        self._launches = {}   # launch_checked's arguments by the call's addresses

    def __call__(self, a, w, dst, bias=None):
        layout = weight_layout(w)
        if INTERPRET or layout is None:   # None: _launch_args' descriptor raises Triton's own error
            _jit_launch(*self._launch_args(a, w, dst, bias))
            return
        launch = self._bind(a, w, dst, bias, layout)
        if launch is not None:
            kernel, grid, args = launch
            kernel(grid, torch._C._cuda_getCurrentRawStream(self.device_index), *args)

    def launch_checked(self, a, w, dst, bias=None):
        """__call__ for a plan's call, whose a, w, dst and bias have the plan's fixed shapes (OpPlan.check_call; dst
        and bias the plan's own or allocated by it): the launch's arguments are kept by the tensors' addresses and
        w's layout, all that a descriptor or a specialization can change at a fixed shape, so a call with the
        addresses of an earlier one (a layer's weight, the allocator's blocks) launches without building any."""
        layout = weight_layout(w)
        if INTERPRET or layout is None:
            self(a, w, dst, bias)
            return
        key = (a.data_ptr(), w.data_ptr(), layout, dst.data_ptr(), None if bias is None else bias.data_ptr())
        launch = self._launches.get(key)
        if launch is None:
            launch = self._bind(a, w, dst, bias, layout)
            if launch is None:   # the variant's first call: launched by the JIT
                return
            if len(self._launches) >= MAX_CACHED_LAUNCHES:
                self._launches.clear()
            self._launches[key] = launch
        kernel, grid, args = launch
        kernel(grid, torch._C._cuda_getCurrentRawStream(self.device_index), *args)

    def _bind(self, a, w, dst, bias, layout):
        """(the DirectKernel, its grid, the launcher's arguments) of a call; None where the call went through the JIT
        instead (the first call of its variant, which also launched it)."""
        dst_ptr = dst.data_ptr()
        bias_ptr = dst_ptr if bias is None else bias.data_ptr()   # the kernel's unused bias pointer: dst's
        variant = (bias is not None, layout, dst_ptr % 16 == 0, bias_ptr % 16 == 0, dst.stride(0))
        found = self._variants.get(variant)
        if found is None:
            grid, rest, options = self._plain_args(a, w, dst, bias)
            key = specialization_key(self.device_index, a, w, rest, options)
            kernel = _shared.get(key)
            if kernel is None:   # compiled (or found in Triton's cache) and launched by the JIT
                _shared[key] = DirectKernel(_jit_launch(grid, _descriptors(a, w, self.config) + rest, options))
                return None
            # the launcher's arguments after the two descriptors, tensors as pointers: dst at 0, bias at 3
            rest = [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in rest]
            found = self._variants[variant] = (kernel, grid, rest)
        kernel, grid, rest = found
        rest = rest.copy()
        rest[0], rest[3] = dst_ptr, bias_ptr
        box_a, box_kn, box_nk = self._boxes
        w_args = (kernel.tma(1, w, box_kn, _kn_rows) if layout == "kn" else kernel.tma(1, w, box_nk, _nk_rows))
        return kernel, grid, (*kernel.tma(0, a, box_a), *w_args, *rest)

    def _plain_args(self, a, w, dst, bias):
        return _plain_args(a, w, dst, self.tiles, self.counters, self.num_programs, self.config, bias, self.bias_rows,
                           self.dst_offsets, self.flags, self.wait_target)

    def _launch_args(self, a, w, dst, bias):
        grid, rest, options = self._plain_args(a, w, dst, bias)
        return grid, _descriptors(a, w, self.config) + rest, options


def _nk_rows(w):
    """The [L*N, K] matrix a row-major weight [.., N, K] is read as."""
    return w.reshape(-1, w.shape[-1])


def _kn_rows(w):
    """The [L*K, N] matrix the transposed view of a row-major [.., K, N] is read as."""
    rows = w.transpose(-2, -1)
    return rows.reshape(-1, rows.shape[-1])


# launch_checked's arguments kept per SignaledGemm: a plan shared by every layer of a shape sees each layer's weight
# with the few addresses its activations get from the allocator
MAX_CACHED_LAUNCHES = 256

# Compiled kernels by their arguments' specialization, shared by every SignaledGemm of the process: the expert ops
# make a SignaledGemm per routing (every step), whose first launch would otherwise go through the JIT's slow lookup
# on the critical path after the routing arrives, and their weights' descriptors stay in the shared kernel's cache.
_shared = {}


def _int_class(x: int):
    """What Triton 3.6 specializes an integer argument on (== 1, divisible by 16, 32-bit or not)."""
    return x == 1, x % 16 == 0, -2 ** 31 <= x < 2 ** 31


def _matrix_class(t: torch.Tensor):
    return (t.dtype, t.data_ptr() % 16 == 0, tuple(map(_int_class, t.shape)), tuple(map(_int_class, t.stride())))


def specialization_key(device_index: int, a, w, rest, options):
    """The key of the compiled kernel for these arguments (rest: _plain_args'), at least as fine as the one Triton's
    JIT computes (its binder: pointers' dtype and 16-byte alignment, integers equal to 1, divisible by 16 or wider
    than 32 bits, except ROUTING_INTS, which only have to fit 32 bits; the tensor descriptors' dtype and box, the
    constexprs, the options), so two launches with one key run one compiled kernel; cheaper than the binder (a new
    routing's first launch is on the host's critical path). The descriptors are keyed by their tensors' alignment,
    shape and strides (more than Triton uses: safe)."""
    plain = rest[:-len(_CONSTEXPRS)]
    return (device_index, _matrix_class(a), _matrix_class(w),
            tuple((x.dtype, x.data_ptr() % 16 == 0) if isinstance(x, torch.Tensor)
                  else -2 ** 31 <= x < 2 ** 31 if name in ROUTING_INTS else _int_class(x)
                  for name, x in zip(_PLAIN, plain)),
            rest[-len(_CONSTEXPRS):], options["num_stages"], options["num_warps"])
