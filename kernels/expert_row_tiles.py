"""The dispatch's row-tile table (a2a_gemm, overlap_tp/ops/moe_tile_plan.py's _dispatch_table) built on the GPU from
the token counts on the GPU.

With a new routing every step the table is needed right after the counts arrive, while the GPU waits for the first
expert GEMM: built on the host it would sit on that path (numpy over the segments, then a copy); built here it costs
one launch, queued behind the counts without the host reading them.

Notation as in moe_tile_plan.py: ep ranks, L local experts, this rank r, counts[s, r*L + l] the rows source s routes
to local expert l. The received rows xr are source-major, expert-minor; block s (the rows from source s) starts at
xr row Y[s] = sum_{s' < s} B[s'] (B[s'] = its rows); segment (s, l) is cut into ceil(rows / BLOCK_M) row tiles. Block
s's n_s row tiles are split into P parts of whole tiles, the first n_s % P one tile larger:
    part(k) = k // (base + 1)                        for k < cut = extra * (base + 1)    (base, extra = divmod(n_s, P))
              extra + (k - cut) // base              otherwise
    first tile of part c: c * base + min(c, extra)
The table runs group 0 (this rank's own block, no wait) then chunk c = 0..P-1 (part c of every remote block, peers
in the order r+1, r+2, ..., each waiting on ready flag c), so a remote tile k of block s lands at row
    start[c] + (part c's tiles of the peers before s) + (k - first tile of part c),   start[c] = n_r + sum_{c' < c} chunk c' tiles
and starts = [0, n_r, start[1], ..., start[P-1], all tiles]. One program per source block; every program computes
the [ep, L] sums it needs itself (a few hundred integers). Fields of a row: rows [lo, hi) of xr, DST_ROW = lo, the
wait (NO_WAIT for the own block, else its part), the expert; COL, DST_COL, GROUP and DST_BUF are 0.
"""
import torch
import triton
import triton.language as tl

from overlap_tp.kernels.direct_launch import DirectKernel
from overlap_tp.kernels.signaled_gemm import (COL, DST_BUF, DST_COL, DST_ROW, EXPERT, GROUP, INTERPRET, NO_WAIT,
                                              SRC_ROW, SRC_ROW_END, TILE_FIELDS, WAIT, RowTiles)


@triton.jit(do_not_specialize=["rank", "ep", "num_experts", "experts", "parts", "chunks"],
            do_not_specialize_on_alignment=["counts_ptr", "rows_ptr", "starts_ptr"])
def dispatch_row_tiles_kernel(counts_ptr, rows_ptr, starts_ptr, rank, ep, num_experts, experts, parts, chunks,
                              BLOCK_M: tl.constexpr, EP: tl.constexpr, LP: tl.constexpr, PARTS: tl.constexpr,
                              BLOCK_T: tl.constexpr, FIELDS: tl.constexpr, F_SRC_ROW: tl.constexpr,
                              F_SRC_ROW_END: tl.constexpr, F_COL: tl.constexpr, F_DST_ROW: tl.constexpr,
                              F_DST_COL: tl.constexpr, F_GROUP: tl.constexpr, F_DST_BUF: tl.constexpr,
                              F_WAIT: tl.constexpr, F_EXPERT: tl.constexpr, NO_WAIT_: tl.constexpr):
    s = tl.program_id(0)
    src = tl.arange(0, EP)
    loc = tl.arange(0, LP)
    part = tl.arange(0, PARTS)
    # every block's segments: counts[s', r*L + l], [EP, LP]
    seg = tl.load(counts_ptr + src[:, None] * num_experts + rank * experts + loc[None, :],
                  mask=(src[:, None] < ep) & (loc[None, :] < experts), other=0).to(tl.int32)
    block_tiles = tl.sum((seg + BLOCK_M - 1) // BLOCK_M, 1)
    block_rows = tl.sum(seg, 1)
    # tiles of part c of every remote block, [EP, PARTS]; chunk c's first row in the table
    peer = (src - rank + ep) % ep
    remote = (src < ep) & (peer > 0)
    size = block_tiles[:, None] // parts + (part[None, :] < (block_tiles % parts)[:, None]).to(tl.int32)
    size = tl.where(remote[:, None] & (part[None, :] < parts), size, 0)
    own = tl.sum(tl.where(src == rank, block_tiles, 0), 0)
    per_chunk = tl.sum(size, 0)
    chunk_start = own + tl.cumsum(per_chunk, 0) - per_chunk
    if s == 0:
        tl.store(starts_ptr, 0)
        tl.store(starts_ptr + 1, own)
        tl.store(starts_ptr + 2 + part, chunk_start + per_chunk, mask=part < chunks)
    # this program's block s: where its part c tiles go (after the peers before s), where it starts in xr
    my_peer = (s - rank + ep) % ep
    before = tl.sum(tl.where((remote & (peer < my_peer))[:, None], size, 0), 0)
    place = chunk_start + before
    y0 = tl.sum(tl.where(src < s, block_rows, 0), 0)
    rows_s = tl.load(counts_ptr + s * num_experts + rank * experts + loc, mask=loc < experts, other=0).to(tl.int32)
    tiles_s = (rows_s + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles_s, 0)
    tile_first = tile_end - tiles_s
    row_first = tl.cumsum(rows_s, 0) - rows_s
    n_s = tl.sum(tiles_s, 0)
    base = n_s // parts
    extra = n_s % parts
    cut = extra * (base + 1)
    for k0 in range(0, n_s, BLOCK_T):
        k = k0 + tl.arange(0, BLOCK_T)
        live = k < n_s
        # the expert of tile k: the experts whose tiles all come before k (empty ones included)
        expert = tl.sum((tile_end[None, :] <= k[:, None]).to(tl.int32), 1)
        pick = loc[None, :] == expert[:, None]
        first = tl.sum(tl.where(pick, tile_first[None, :], 0), 1)
        seg_lo = y0 + tl.sum(tl.where(pick, row_first[None, :], 0), 1)
        seg_hi = seg_lo + tl.sum(tl.where(pick, rows_s[None, :], 0), 1)
        lo = seg_lo + (k - first) * BLOCK_M
        hi = tl.minimum(lo + BLOCK_M, seg_hi)
        c = tl.where(k < cut, k // (base + 1), extra + (k - cut) // tl.maximum(base, 1))
        remote_row = tl.sum(tl.where(part[None, :] == c[:, None], place[None, :], 0), 1) + k - (
            c * base + tl.minimum(c, extra))
        row = tl.where(my_peer == 0, k, remote_row)
        wait = tl.where(my_peer == 0, NO_WAIT_, c)
        out = rows_ptr + row * FIELDS
        zero = tl.zeros_like(k)
        tl.store(out + F_SRC_ROW, lo, mask=live)
        tl.store(out + F_SRC_ROW_END, hi, mask=live)
        tl.store(out + F_COL, zero, mask=live)
        tl.store(out + F_DST_ROW, lo, mask=live)
        tl.store(out + F_DST_COL, zero, mask=live)
        tl.store(out + F_GROUP, zero, mask=live)
        tl.store(out + F_DST_BUF, zero, mask=live)
        tl.store(out + F_WAIT, wait, mask=live)
        tl.store(out + F_EXPERT, expert, mask=live)


BLOCK_T = 128


class DispatchRowTiles:
    """dispatch_row_tiles_kernel for one device: compiled at its first launch for a (BLOCK_M, ep, L, parts) size
    class, then launched as a DirectKernel (no argument is specialized, so one binary serves every routing)."""

    def __init__(self):
        self._compiled = {}

    def __call__(self, counts: torch.Tensor, rank: int, experts: int, parts: int, block_m: int, num_row_tiles: int,
                 n_tiles: int, raster_m: int) -> RowTiles:
        """The dispatch's RowTiles from counts [ep, E] (int64, on the GPU): num_row_tiles rows (the plan's count)."""
        ep, num_experts = counts.shape
        chunks = parts if ep > 1 else 0
        rows = torch.empty(num_row_tiles, TILE_FIELDS, dtype=torch.int32, device=counts.device)
        starts = torch.empty(chunks + 2, dtype=torch.int32, device=counts.device)
        constexprs = (block_m, triton.next_power_of_2(ep), triton.next_power_of_2(experts),
                      triton.next_power_of_2(max(parts, 2)), BLOCK_T, TILE_FIELDS, SRC_ROW, SRC_ROW_END, COL, DST_ROW,
                      DST_COL, GROUP, DST_BUF, WAIT, EXPERT, NO_WAIT)
        args = (counts, rows, starts, rank, ep, num_experts, experts, parts, chunks)
        kernel = None if INTERPRET else self._compiled.get((counts.device, constexprs))
        if kernel is None:
            compiled = dispatch_row_tiles_kernel[(ep,)](*args, *constexprs, num_warps=4)
            if not INTERPRET:
                self._compiled[counts.device, constexprs] = DirectKernel(compiled)
        else:
            kernel(ep, torch._C._cuda_getCurrentRawStream(counts.device.index), counts.data_ptr(), rows.data_ptr(),
                   starts.data_ptr(), *args[3:], *constexprs)
        return RowTiles(rows, starts, n_tiles, raster_m)


dispatch_row_tiles = DispatchRowTiles()
