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
from dataclasses import dataclass
from typing import List, Tuple

import torch

from overlap_tp.kernels.signaled_gemm import RowTiles
from overlap_tp.ops.tile_plan import MAX_AUTO_GROUPS, NO_WAIT, RASTER_GROUP_M, TARGET_GROUP_BYTES, TILE_FIELDS

# gemm_a2a's destination buffers (the tiles' DST_BUF): the staging matrix and the output z
STAGING, OUTPUT = 0, 1


@dataclass(frozen=True)
class Piece:
    """GEMM rows [src_lo, src_hi) of one local expert, stored to rows [dst_lo, dst_lo + src_hi - src_lo)
    of destination buffer dst_buf."""
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

    def expert_rows(self, per_expert, src, dst) -> List[int]:
        """counts[src, dst*L : (dst+1)*L] (per_expert = counts.tolist()): the block (src -> dst) per expert."""
        return per_expert[src][dst * self.experts:(dst + 1) * self.experts]


@dataclass(frozen=True)
class ExpertPlan:
    op: str                                   # "a2a_gemm" or "gemm_a2a"
    layout: Layout
    n: int                                    # the GEMM's output columns per expert
    block_m: int
    block_n: int
    parts: int                                # P, parts per peer
    local: Tuple[int, int, int]               # a2a_gemm: x rows [lo, hi) copied to xr rows from the third
    gemm_groups: Tuple[Tuple[Piece, ...], ...]   # the GEMM's rows, in execution order, per group
    exchanges: Tuple[Exchange, ...]           # per chunk (a2a_gemm) or group (gemm_a2a), in order
    staging_rows: int                         # gemm_a2a: rows of the staging matrix (the remote blocks)
    tiles: RowTiles                           # the row tiles of every group, in order (kernels/signaled_gemm.py)
    group_tiles: Tuple[int, ...]              # a2a_gemm: tiles waiting on each flag; gemm_a2a: per counter

    @property
    def num_tiles(self) -> int:
        return self.tiles.num_tiles


def layout(counts: torch.Tensor, rank: int) -> Layout:
    """What rank `rank` holds, from counts alone (see Layout)."""
    ep, num_experts = counts.shape
    experts = num_experts // ep
    per_expert = counts.tolist()
    pairs = counts.reshape(ep, ep, experts).sum(2)                  # B[s, d]
    x_offsets = [0] + torch.cumsum(pairs[rank], 0).tolist()[:-1]
    xr_offsets = [0] + torch.cumsum(pairs[:, rank], 0).tolist()[:-1]
    segments, row = [], 0
    for s in range(ep):
        for l, rows in enumerate(per_expert[s][rank * experts:(rank + 1) * experts]):
            segments.append(Piece(row, row + rows, l, 0, row))
            row += rows
    return Layout(ep, experts, rank, int(pairs[rank].sum()), row, tuple(pairs[rank].tolist()),
                  tuple(pairs[:, rank].tolist()), tuple(x_offsets), tuple(xr_offsets), tuple(segments))


def parts_per_peer(counts: torch.Tensor, groups, row_bytes: int) -> int:
    """P, the same on every rank: `groups` itself if an int; "auto": about TARGET_GROUP_BYTES of remote
    rows per group on the busiest rank (the most rows sent to or received from peers), 2 to
    MAX_AUTO_GROUPS groups."""
    if isinstance(groups, int) and not isinstance(groups, bool):
        return groups
    if groups != "auto":
        raise ValueError(f"the expert ops take groups='auto' or an int (parts per peer), got {groups!r}")
    ep = counts.shape[0]
    remote = counts.reshape(ep, ep, -1).sum(2).fill_diagonal_(0)
    busiest = int(max(remote.sum(0).max(), remote.sum(1).max()))
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


def block_pieces(expert_rows, lo, hi, src_base, dst_buf, dst_base) -> List[Piece]:
    """Rows [lo, hi) of one block (block coordinates) cut at its experts' segment boundaries; the
    block starts at src_base in the GEMM's input and at dst_base in destination buffer dst_buf."""
    pieces, start = [], 0
    for l, rows in enumerate(expert_rows):
        a, b = max(lo, start), min(hi, start + rows)
        if a < b:
            pieces.append(Piece(src_base + a, src_base + b, l, dst_buf, dst_base + a))
        start += rows
    return pieces


def tile_table(gemm_groups, fields, n: int, block_m: int, block_n: int):
    """The row tiles of every group's pieces, in order, as a RowTiles (the kernel expands each into its N-tiles,
    rastered within the group); fields[i] = (GROUP, WAIT) of group i. Returns (RowTiles, tiles per group).
    Expert plans are rebuilt on every call (the counts change every step), on the host, right after the step's
    routing reached it, while the GPU waits for the first expert GEMM: one row per row tile (a few hundred) is
    what the host writes and copies, where the expanded table had one per tile (tens of thousands; 0.6 ms to
    build and ~1 ms of GPU idle per step at Mixtral's shapes, docs/perf/s14/README.md)."""
    rows, starts = [], [0]
    for pieces, (group, wait) in zip(gemm_groups, fields):
        for p in pieces:
            for lo in range(p.src_lo, p.src_hi, block_m):
                rows.append((lo, min(lo + block_m, p.src_hi), 0, p.dst_lo + lo - p.src_lo, 0, group, p.dst_buf, wait,
                             p.expert))
        starts.append(len(rows))
    table = RowTiles(torch.tensor(rows, dtype=torch.int32).reshape(-1, TILE_FIELDS),
                     torch.tensor(starts, dtype=torch.int32), -(-n // block_n), RASTER_GROUP_M)
    return table, table.group_tiles()


def dispatch_plan(counts: torch.Tensor, rank: int, n: int, block_m: int, block_n: int, parts: int) -> ExpertPlan:
    """a2a_gemm on rank `rank`: y[R, n] over xr; see the module docstring."""
    lay = layout(counts, rank)
    per_expert = counts.tolist()
    peers = [(rank + i) % lay.ep for i in range(1, lay.ep)]
    own = lay.expert_rows(per_expert, rank, rank)
    y0 = lay.xr_offsets[rank]
    gemm_groups = [block_pieces(own, 0, lay.x_splits[rank], y0, 0, y0)]
    send_bounds = {d: part_bounds(lay.expert_rows(per_expert, rank, d), block_m, parts) for d in peers}
    recv_bounds = {s: part_bounds(lay.expert_rows(per_expert, s, rank), block_m, parts) for s in peers}
    exchanges = []
    for c in range(parts if peers else 0):
        chunk = []
        for s in peers:
            ys = lay.xr_offsets[s]
            chunk += block_pieces(lay.expert_rows(per_expert, s, rank), recv_bounds[s][c], recv_bounds[s][c + 1],
                                  ys, 0, ys)
        gemm_groups.append(chunk)
        exchanges.append(_exchange([(d, lay.x_offsets[d], send_bounds[d], c) for d in peers],
                                   [(s, lay.xr_offsets[s], recv_bounds[s], c) for s in peers]))
    fields = [(0, NO_WAIT)] + [(0, c) for c in range(len(exchanges))]
    tiles, group_tiles = tile_table(gemm_groups, fields, n, block_m, block_n)
    local = (lay.x_offsets[rank], lay.x_offsets[rank] + lay.x_splits[rank], y0)
    return ExpertPlan("a2a_gemm", lay, n, block_m, block_n, parts, local, tuple(map(tuple, gemm_groups)),
                      tuple(exchanges), 0, tiles, tuple(group_tiles[1:]))


def combine_plan(counts: torch.Tensor, rank: int, n: int, block_m: int, block_n: int, parts: int) -> ExpertPlan:
    """gemm_a2a on rank `rank`: z[T, n] from h[R, :]; see the module docstring."""
    lay = layout(counts, rank)
    per_expert = counts.tolist()
    peers = [(rank + i) % lay.ep for i in range(1, lay.ep)]
    local_rows = lay.xr_splits[rank]
    staged = {d: lay.xr_offsets[d] - (local_rows if d > rank else 0) for d in peers}   # block d's staging row
    send_bounds = {d: part_bounds(lay.expert_rows(per_expert, d, rank), block_m, parts) for d in peers}
    recv_bounds = {s: part_bounds(lay.expert_rows(per_expert, rank, s), block_m, parts) for s in peers}
    gemm_groups, exchanges = [], []
    for g in range(parts if peers else 0):
        group = []
        for d in peers:
            group += block_pieces(lay.expert_rows(per_expert, d, rank), send_bounds[d][g], send_bounds[d][g + 1],
                                  lay.xr_offsets[d], STAGING, staged[d])
        gemm_groups.append(group)
        exchanges.append(_exchange([(d, staged[d], send_bounds[d], g) for d in peers],
                                   [(s, lay.x_offsets[s], recv_bounds[s], g) for s in peers]))
    gemm_groups.append(block_pieces(lay.expert_rows(per_expert, rank, rank), 0, local_rows, lay.xr_offsets[rank],
                                    OUTPUT, lay.x_offsets[rank]))
    fields = [(g, NO_WAIT) for g in range(len(gemm_groups))]
    tiles, group_tiles = tile_table(gemm_groups, fields, n, block_m, block_n)
    return ExpertPlan("gemm_a2a", lay, n, block_m, block_n, parts, (0, 0, 0), tuple(map(tuple, gemm_groups)),
                      tuple(exchanges), lay.rows - local_rows, tiles, tuple(group_tiles))


def _exchange(sends, recvs) -> Exchange:
    """Part c of every listed block: (peer, block start in the buffer, the block's part bounds, c)."""
    def ranges(blocks):
        return tuple((peer, base + bounds[c], base + bounds[c + 1]) for peer, base, bounds, c in blocks
                     if bounds[c] < bounds[c + 1])
    return Exchange(ranges(sends), ranges(recvs))
