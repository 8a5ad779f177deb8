"""Expert-parallel plans for the MoE all-to-all ops (overlap_tp/ops/expert.py): where every row goes, in
which group it travels, and the grouped GEMM's tile table. Pure host arithmetic on the token-count
matrix (no torch.distributed): every rank derives every split size from `counts` alone, identically, so
no host synchronization is added to the one Megatron's dispatcher already does for its split sizes.

Notation. ep ranks, L local experts each, E = ep*L global experts; rank r owns experts [r*L, (r+1)*L).
counts[s, e] = rows rank s routes to global expert e. Rank s's x is sorted by global expert, so the rows
s sends to d (d's experts) are one contiguous block of x_s; d receives them as one contiguous block of
its xr, whose blocks are in source order (source-major, local expert minor: Megatron's all_to_all
output). For the pair (s -> d):
    B[s, d] = sum_l counts[s, d*L + l]           rows in the block
    X[s, d] = sum_{e < d*L} counts[s, e]         where the block starts in x_s (and in z_s, the combine's output)
    Y[s, d] = sum_{s' < s} B[s', d]              where it starts in xr_d (and in y_d, h_d)
Inside the block, expert l's segment starts at sum_{l' < l} counts[s, d*L + l'] on both sides.

Row tiles and parts. The grouped GEMM cuts every (pair, expert) segment into ceil(rows / block_m) row
tiles, the last one partial, so no tile straddles two experts or two pairs. A block's row tiles are
split into P near-equal runs of whole tiles (the first runs one tile larger; empty runs where the block
has fewer than P tiles): part c of the block is the row range its run covers. Both ends of a pair
compute the same parts from counts[s, d*L:(d+1)*L], block_m and P; P is a function of counts.

a2a_gemm (dispatch + fc1) on rank r, y[j] = xr[j] @ w[l].T for the expert l of row j:
    the local block x_r[X[r,r] : +B[r,r]] is copied to xr_r[Y[r,r] : ...]; its tiles wait for nothing;
    chunk c = part c of every remote block: one exchange (send part c of every (r -> d) block of x_r,
    receive part c of every (s -> r) block into xr_r at its standard rows), then ready flag c is raised;
    the chunk's tiles (peers r+1, r+2, ...) wait on flag c.
gemm_a2a (fc2 + combine) on rank r, out[j] = h[j] @ w[l].T, sent back to the row's source:
    group g = part g of every remote block (d -> r): its tiles are stored into a staging matrix holding
    the remote blocks in h order (staging row = h row, minus B[r,r] past the local block); once group
    g's counter is complete, one exchange sends part g of every staged block to its d and receives part
    g of every (r -> s) block from s straight into z_r[X[r,s] + part rows]. The local block's tiles
    come last and store straight into z_r[X[r,r] + (h row - Y[r,r])]: the local rows are never copied.
"""
import functools
from dataclasses import dataclass
from typing import List, NamedTuple, Tuple

import numpy as np
import torch

from overlap_tp.kernels.signaled_gemm import RowTiles
from overlap_tp.ops.tile_plan import (COL, DST_BUF, DST_COL, DST_ROW, EXPERT, GROUP, MAX_AUTO_GROUPS, NO_WAIT,
                                      SRC_ROW, SRC_ROW_END, TARGET_GROUP_BYTES, TILE_FIELDS, WAIT, ring_peers)

# gemm_a2a's destination buffers (the tiles' DST_BUF): the staging matrix and the output z
STAGING, OUTPUT = 0, 1
# The grouped GEMMs' raster run (RowTiles.raster_m: row tiles per run, the N-tile outer within it): at Mixtral's
# per-rank shapes runs of 32 measured faster than the dense plans' 8 and than 128 on fc1 and fc2, uniform and zipf
# routing alike (docs/performance.md).
EXPERT_RASTER_M = 32


class Piece(NamedTuple):
    """GEMM rows [src_lo, src_hi) of one local expert, stored to rows [dst_lo, dst_lo + src_hi - src_lo)
    of destination buffer dst_buf. A named tuple: plans build hundreds per routing, on the host's critical path
    (a frozen dataclass costs several times more to construct)."""
    src_lo: int
    src_hi: int
    expert: int
    dst_buf: int
    dst_lo: int


@dataclass(frozen=True)
class Exchange:
    """One grouped point-to-point exchange: rows [lo, hi) of the send buffer go to `peer`, rows [lo, hi)
    of the receive buffer come from `peer`. Empty ranges are left out (both ends agree on them)."""
    sends: Tuple[Tuple[int, int, int], ...]   # (peer, lo, hi)
    recvs: Tuple[Tuple[int, int, int], ...]   # (peer, lo, hi)


@dataclass(frozen=True)
class Layout:
    """What rank `rank` holds: x / z (tokens rows, by global expert) and xr / y / h (rows, by source then
    local expert); the all-to-all split sizes per rank and the xr rows of every (source, expert) segment."""
    ep: int
    experts: int                      # L, local experts per rank
    rank: int
    tokens: int                       # T: rows of x and z
    rows: int                         # R: rows of xr, y and h
    x_splits: Tuple[int, ...]         # B[rank, d]: x rows per destination d (dispatch send sizes)
    xr_splits: Tuple[int, ...]        # B[s, rank]: xr rows per source s (dispatch receive sizes)
    x_offsets: Tuple[int, ...]        # X[rank, d]
    xr_offsets: Tuple[int, ...]       # Y[s, rank]
    segments: Tuple[Piece, ...]       # per (source, local expert), source-major: xr rows, stored in place
    counts: Tuple[Tuple[int, ...], ...]   # the counts matrix [ep, E] as ints

    def expert_rows(self, src, dst) -> Tuple[int, ...]:
        """counts[src, dst*L : (dst+1)*L]: the block (src -> dst) per expert."""
        return self.counts[src][dst * self.experts:(dst + 1) * self.experts]


@dataclass(frozen=True)
class ExpertPlan:
    op: str                                   # "a2a_gemm" or "gemm_a2a"
    layout: Layout
    n: int                                    # the GEMM's output columns per expert
    block_m: int
    block_n: int
    parts: int                                # P, parts per peer
    local: Tuple[int, int, int]               # a2a_gemm: x rows [lo, hi) copied to xr rows from the third
    exchanges: Tuple[Exchange, ...]           # per chunk (a2a_gemm) or group (gemm_a2a), in order
    staging_rows: int                         # gemm_a2a: rows of the staging matrix (the remote blocks)
    group_tiles: Tuple[int, ...]              # a2a_gemm: tiles waiting on each flag; gemm_a2a: per counter
    num_tiles: int                            # the GEMM's tiles (row tiles x N-tiles)

    @functools.cached_property
    def tiles(self) -> RowTiles:
        """The row tiles of every group, in order (kernels/signaled_gemm.py), built on the host at the first use: the
        signaled dispatch on a GPU builds its table there instead (kernels/expert_row_tiles.py), from counts on
        the device, so a new routing's plan does not wait for this."""
        build = _dispatch_table if self.op == "a2a_gemm" else _combine_table
        return build(self.layout, self.n, self.block_m, self.block_n, self.parts)

    @functools.cached_property
    def gemm_groups(self) -> Tuple[Tuple[Piece, ...], ...]:
        """The GEMM's rows per group, in execution order, as pieces (the decomposed method makes one cuBLAS call
        per piece), derived from the host table at the first use: the signaled method never asks."""
        return _pieces(self.tiles.rows.numpy(), self.tiles.starts.numpy())


def layout(counts: torch.Tensor, rank: int) -> Layout:
    """What rank `rank` holds, from counts alone (see Layout). Plain Python over counts.tolist(): the matrix is
    small and every torch op on it costs more than the arithmetic (a new routing every step, on the host's
    critical path)."""
    ep, num_experts = counts.shape
    experts = num_experts // ep
    per_expert = counts.tolist()
    pairs = [[sum(row[d * experts:(d + 1) * experts]) for d in range(ep)] for row in per_expert]   # B[s, d]
    sent, received = pairs[rank], [pairs[s][rank] for s in range(ep)]
    segments, row = [], 0
    for s in range(ep):
        for l, rows in enumerate(per_expert[s][rank * experts:(rank + 1) * experts]):
            segments.append(Piece(row, row + rows, l, 0, row))
            row += rows
    return Layout(ep, experts, rank, sum(sent), row, tuple(sent), tuple(received), _exclusive_sums(sent),
                  _exclusive_sums(received), tuple(segments), tuple(map(tuple, per_expert)))


def _exclusive_sums(values) -> Tuple[int, ...]:
    sums, total = [], 0
    for v in values:
        sums.append(total)
        total += v
    return tuple(sums)


def parts_per_peer(counts, groups, row_bytes: int) -> int:
    """P, the same on every rank: `groups` itself if an int; "auto": about TARGET_GROUP_BYTES of remote
    rows per group on the busiest rank (the most rows sent to or received from peers), 2 to
    MAX_AUTO_GROUPS groups. counts: the [ep, E] tensor or its rows as lists (Layout.counts)."""
    if isinstance(groups, int) and not isinstance(groups, bool):
        return groups
    if groups != "auto":
        raise ValueError(f"the expert ops take groups='auto' or an int (parts per peer), got {groups!r}")
    rows = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    ep = len(rows)
    experts = len(rows[0]) // ep if ep else 0
    remote = [[0 if s == d else sum(rows[s][d * experts:(d + 1) * experts]) for d in range(ep)] for s in range(ep)]
    busiest = max([sum(r) for r in remote] + [sum(col) for col in zip(*remote)] + [0])
    return max(1, min(MAX_AUTO_GROUPS, max(2, round(busiest * row_bytes / TARGET_GROUP_BYTES))))


def part_bounds(expert_rows: List[int], block_m: int, parts: int) -> List[int]:
    """Row bounds b_0 = 0 <= ... <= b_P = rows of one block: part c is rows [b_c, b_{c+1}), a run of
    whole row tiles (tiles start every block_m rows of each expert's segment)."""
    starts, row = [], 0
    for rows in expert_rows:
        starts += range(row, row + rows, block_m)
        row += rows
    base, extra = divmod(len(starts), parts)
    bounds, tile = [0], 0
    for c in range(parts):
        tile += base + (c < extra)
        bounds.append(starts[tile] if tile < len(starts) else row)
    return bounds


class ReceivedTiles(NamedTuple):
    """Every row tile of the received rows (xr, h: source-major, local expert minor), in row order (numpy int64
    arrays, one entry per row tile): rows [lo, hi) of local expert `expert`, from source rank `source`; `index`
    is its place among the row tiles of its block (source -> this rank) and `part` the part of that block it
    belongs to (part_bounds' split: the first `extra` parts one tile larger)."""
    lo: np.ndarray
    hi: np.ndarray
    source: np.ndarray
    expert: np.ndarray
    index: np.ndarray
    part: np.ndarray


def received_tiles(lay: Layout, block_m: int, parts: int) -> ReceivedTiles:
    """The row tiles of lay's received rows (see ReceivedTiles), computed with numpy over the [ep, L] segments: the
    plans are rebuilt for every routing (every step), on the host, while the GPU waits for the first expert GEMM,
    and a Python loop per tile or per piece costs too much host time per plan at EP 8 with 64 experts."""
    ep, experts = lay.ep, lay.experts
    seg_rows = np.array([lay.expert_rows(s, lay.rank) for s in range(ep)], dtype=np.int64).reshape(-1)
    seg_start = np.cumsum(seg_rows) - seg_rows
    seg_tiles = -(-seg_rows // block_m)
    segment = np.repeat(np.arange(seg_rows.size), seg_tiles)
    k = np.arange(segment.size) - np.repeat(np.cumsum(seg_tiles) - seg_tiles, seg_tiles)
    lo = seg_start[segment] + k * block_m
    hi = np.minimum(lo + block_m, (seg_start + seg_rows)[segment])
    source = segment // max(experts, 1)
    block_tiles = seg_tiles.reshape(ep, experts).sum(1)
    index = np.arange(segment.size) - np.repeat(np.cumsum(block_tiles) - block_tiles, block_tiles)
    base, extra = np.divmod(block_tiles, parts)
    cut = (extra * (base + 1))[source]          # tiles in the first `extra` (larger) parts
    part = np.where(index < cut, index // (base + 1)[source],
                    extra[source] + (index - cut) // np.maximum(base, 1)[source])
    return ReceivedTiles(lo, hi, source, segment % max(experts, 1), index, part)


def _plan_tiles(lay: Layout, tiles: ReceivedTiles, group, order_group, dst_row, dst_buf, wait, groups: int, n: int,
                block_n: int):
    """The plan's RowTiles from the received row tiles and their fields (arrays, one per row tile): run in the
    order of order_group, then peer (this rank's own rows first, then rank+1, rank+2, ...), then place in the
    block."""
    peer = (tiles.source - lay.rank) % lay.ep
    order = np.lexsort((tiles.index, peer, order_group))
    table = np.empty((order.size, TILE_FIELDS), dtype=np.int32)
    table[:, SRC_ROW], table[:, SRC_ROW_END] = tiles.lo[order], tiles.hi[order]
    table[:, COL] = table[:, DST_COL] = 0
    table[:, DST_ROW], table[:, GROUP], table[:, DST_BUF] = dst_row[order], group[order], dst_buf[order]
    table[:, WAIT], table[:, EXPERT] = wait[order], tiles.expert[order]
    starts = np.zeros(groups + 1, dtype=np.int32)
    np.cumsum(np.bincount(order_group, minlength=groups), out=starts[1:])
    return RowTiles(torch.from_numpy(table), torch.from_numpy(starts), -(-n // block_n), EXPERT_RASTER_M)


def _pieces(table: np.ndarray, starts: np.ndarray):
    """Per group, its row tiles merged into pieces (runs of one expert, contiguous source and destination rows,
    one destination buffer): one cuBLAS call each in the decomposed method."""
    if table.shape[0] == 0:
        return ((),) * (starts.size - 1)
    lo, hi, dst, buf, expert = (table[:, f].astype(np.int64) for f in (SRC_ROW, SRC_ROW_END, DST_ROW, DST_BUF, EXPERT))
    new = np.ones(lo.size, dtype=bool)
    new[1:] = (lo[1:] != hi[:-1]) | (expert[1:] != expert[:-1]) | (buf[1:] != buf[:-1]) | (dst[1:] - lo[1:] != dst[:-1] - lo[:-1])
    new[starts[:-1][starts[:-1] < lo.size]] = True
    first = np.flatnonzero(new)
    last = np.append(first[1:], lo.size) - 1
    runs = list(zip(lo[first].tolist(), hi[last].tolist(), expert[first].tolist(), buf[first].tolist(),
                    dst[first].tolist()))
    run_starts = np.searchsorted(first, starts).tolist()
    return tuple(tuple(Piece(*run) for run in runs[a:b]) for a, b in zip(run_starts, run_starts[1:]))


def part_tiles(lay: Layout, block_m: int, parts: int):
    """(row tiles of each received block, per block the row tiles of each of its parts): what the plans' tile counts
    need, in plain Python over the [ep, L] segments (the tables themselves: _dispatch_table, _combine_table)."""
    block = [sum(-(-rows // block_m) for rows in lay.expert_rows(s, lay.rank)) for s in range(lay.ep)]
    return block, [[b // parts + (c < b % parts) for c in range(parts)] for b in block]


def dispatch_plan(lay: Layout, n: int, block_m: int, block_n: int, parts: int) -> ExpertPlan:
    """a2a_gemm on rank lay.rank: y[R, n] over xr; see the module docstring. GEMM groups: the local block (no
    wait), then chunk c = part c of every remote block (waits on ready flag c)."""
    rank = lay.rank
    peers = ring_peers(rank, lay.ep)
    chunks = parts if peers else 0
    n_tiles = -(-n // block_n)
    block, sizes = part_tiles(lay, block_m, parts)
    send_bounds = {d: part_bounds(lay.expert_rows(rank, d), block_m, parts) for d in peers}
    recv_bounds = {s: part_bounds(lay.expert_rows(s, rank), block_m, parts) for s in peers}
    exchanges = tuple(_exchange([(d, lay.x_offsets[d], send_bounds[d], c) for d in peers],
                                [(s, lay.xr_offsets[s], recv_bounds[s], c) for s in peers]) for c in range(chunks))
    y0 = lay.xr_offsets[rank]
    local_rows = (lay.x_offsets[rank], lay.x_offsets[rank] + lay.x_splits[rank], y0)
    group_tiles = tuple(sum(sizes[s][c] for s in peers) * n_tiles for c in range(chunks))
    return ExpertPlan("a2a_gemm", lay, n, block_m, block_n, parts, local_rows, exchanges, 0, group_tiles,
                      sum(block) * n_tiles)


def _dispatch_table(lay: Layout, n: int, block_m: int, block_n: int, parts: int) -> RowTiles:
    tiles = received_tiles(lay, block_m, parts)
    local = tiles.source == lay.rank
    zeros = np.zeros_like(tiles.lo)
    return _plan_tiles(lay, tiles, zeros, np.where(local, 0, 1 + tiles.part), tiles.lo, zeros,
                       np.where(local, NO_WAIT, tiles.part), 1 + (parts if lay.ep > 1 else 0), n, block_n)


def combine_plan(lay: Layout, n: int, block_m: int, block_n: int, parts: int) -> ExpertPlan:
    """gemm_a2a on rank lay.rank: z[T, n] from h[R, :]; see the module docstring. GEMM groups: group g = part g of
    every remote block (stored to the staging matrix, counter g), then the local block (stored into z)."""
    rank = lay.rank
    peers = ring_peers(rank, lay.ep)
    groups = parts if peers else 0
    local_rows = lay.xr_splits[rank]
    n_tiles = -(-n // block_n)
    block, sizes = part_tiles(lay, block_m, parts)
    staged = {d: lay.xr_offsets[d] - (local_rows if d > rank else 0) for d in peers}   # block d's staging row
    send_bounds = {d: part_bounds(lay.expert_rows(d, rank), block_m, parts) for d in peers}
    recv_bounds = {s: part_bounds(lay.expert_rows(rank, s), block_m, parts) for s in peers}
    exchanges = tuple(_exchange([(d, staged[d], send_bounds[d], g) for d in peers],
                                [(s, lay.x_offsets[s], recv_bounds[s], g) for s in peers]) for g in range(groups))
    group_tiles = tuple(sum(sizes[s][g] for s in peers) * n_tiles for g in range(groups)) + (block[rank] * n_tiles,)
    return ExpertPlan("gemm_a2a", lay, n, block_m, block_n, parts, (0, 0, 0), exchanges, lay.rows - local_rows,
                      group_tiles, sum(block) * n_tiles)


def _combine_table(lay: Layout, n: int, block_m: int, block_n: int, parts: int) -> RowTiles:
    rank, groups = lay.rank, parts if lay.ep > 1 else 0
    tiles = received_tiles(lay, block_m, parts)
    local = tiles.source == rank
    group = np.where(local, groups, tiles.part)
    # remote rows keep their h row in the staging matrix, less the local block where it precedes them; local rows
    # go to their token's row of z
    dst_row = np.where(local, tiles.lo - lay.xr_offsets[rank] + lay.x_offsets[rank],
                       tiles.lo - np.where(tiles.source > rank, lay.xr_splits[rank], 0))
    return _plan_tiles(lay, tiles, group, group, dst_row, np.where(local, OUTPUT, STAGING),
                       np.full_like(tiles.lo, NO_WAIT), groups + 1, n, block_n)


def x_starts(lay: Layout) -> List[int]:
    """X[s, rank] for every rank s: where the rows s routes to this rank's experts start in s's x (and in s's z)."""
    return [sum(lay.counts[s][:lay.rank * lay.experts]) for s in range(lay.ep)]


def pulled_rows(lay: Layout, exchange: Exchange) -> List[Tuple[int, int, int, int]]:
    """The p2p dispatch's copies for one chunk: (peer, row of the peer's x, row of this rank's xr, rows) for every
    block part this rank receives; the peer's x rows are the ones its own exchange sends here (same part bounds on
    both ends)."""
    starts = x_starts(lay)
    return [(peer, starts[peer] + lo - lay.xr_offsets[peer], lo, hi - lo) for peer, lo, hi in exchange.recvs]


def pushed_rows(lay: Layout, exchange: Exchange) -> List[Tuple[int, int, int, int]]:
    """The p2p combine's copies for one group: (peer, row of the peer's z, row of this rank's staging matrix, rows)
    for every staged block part this rank sends; the peer's z rows are the ones its own exchange receives from here."""
    starts, rank, local = x_starts(lay), lay.rank, lay.xr_splits[lay.rank]
    staged = [lay.xr_offsets[d] - (local if d > rank else 0) for d in range(lay.ep)]   # combine_plan's `staged`
    return [(peer, starts[peer] + lo - staged[peer], lo, hi - lo) for peer, lo, hi in exchange.sends]


def _exchange(sends, recvs) -> Exchange:
    """Part c of every listed block: (peer, block start in the buffer, the block's part bounds, c)."""
    def ranges(blocks):
        return tuple((peer, base + bounds[c], base + bounds[c + 1]) for peer, base, bounds, c in blocks
                     if bounds[c] < bounds[c + 1])
    return Exchange(ranges(sends), ranges(recvs))
