"""Tile plans: the order in which the signaled GEMM computes tiles, where each tile is stored, which
group it signals, and which collective moves each group.

A plan is a host-side table, so the kernel stays generic (it reads, per execution index e, where to
load and where to store) and every schedule can be checked against brute force on the CPU.

Notation (DESIGN.md section 2): the GEMM computes C[M, N] = A[M, K] @ W[N, K].T; t ranks; rank k's
sequence-parallel rows are the region [k*M/t, (k+1)*M/t). For GEMM+ReduceScatter every rank computes a
partial C and rank k must receive the sum of all partials over its region. For GEMM+AllReduce the
layout needs no regions: plans are built with t = 1 and the collective is an all-reduce.

Row-slice schedule (lands in the standard layout, no reorder after the collective):
    execution order: for each row-slice j (block_m rows of every region), for each region k, all
    N-tiles, rastered within a group (`raster`: runs of 8 tile rows share the N-tiles of W in L2). A
    group is a run of whole row-slices [j0, j1) covering local rows [lo, hi). The epilogue
    stores tile (k, j, n) into the group's staging block laid out as [t, hi - lo, N]:
        staging row = t*lo + k*(hi - lo) + (j*block_m - lo)
    so reduce_scatter(staging[t*lo : t*hi]) delivers local rows [lo, hi) straight to every rank.

Tile-exact schedule (FlashOverlap's general case):
    execution order: the rank-local tile raster (grouped by 8 tile-rows for L2 reuse), each position
    computed for every region in turn. A group is a run of positions [u0, u1); tile (u, k) is stored
    as a contiguous block_m x block_n block in slot  t*u0 + k*(u1 - u0) + (u - u0),  so after the
    reduce-scatter a rank holds its tiles in execution order (slot u); the plan's TileOrder
    (`slot_of[mi, ni]` = u) undoes it, or the fused RMSNorm reads the tiles where they are.
"""
import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from overlap_tp.kernels.signaled_gemm import (COL, DST_BUF, DST_COL, DST_ROW, EXPERT, GROUP, NO_WAIT, SRC_ROW,  # noqa: F401
                                              SRC_ROW_END, TILE_FIELDS, WAIT)
from overlap_tp.kernels.tile_order import TileOrder

# Output bytes per group the first partition rule aims at: NCCL nears its bus bandwidth around 16 MB over
# NVLink, while smaller messages are latency-bound.
TARGET_GROUP_BYTES = 16 << 20
MAX_AUTO_GROUPS = 8
RASTER_GROUP_M = 8
P2P_ROW_MAJOR_MAX_N_TILES = 16   # p2p_plan's tile order: row-major up to this many N-tiles, rastered above


@dataclass(frozen=True)
class Collective:
    """One group's collective: staging rows [src_lo, src_hi) -> output rows [dst_lo, dst_hi)."""
    src_lo: int
    src_hi: int
    dst_lo: int
    dst_hi: int


@dataclass(frozen=True)
class TilePlan:
    schedule: str
    m: int
    n: int
    world: int              # regions in the layout: t for reduce-scatter, 1 for all-reduce
    block_m: int
    block_n: int
    tiles: torch.Tensor     # int32 [num_tiles, TILE_FIELDS] in execution order
    group_tiles: Tuple[int, ...]
    collectives: Tuple[Collective, ...]
    staging_shape: Tuple[int, int]   # the matrix the epilogue stores into
    out_shape: Tuple[int, int]       # the matrix the collective writes (per rank)
    tile_order: Optional[TileOrder]  # tile_exact only: where each output block sits after the collective
    chunk_peers: Optional[Tuple[int, ...]] = None   # ag_plan with chunk_by 'peer': the one peer each chunk's rows
                                                    # come from (None: every peer's); p2p_copy_plan: each group's owner

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[0]

    @property
    def num_groups(self) -> int:
        return len(self.group_tiles)


def split_units(total: int, groups, unit_bytes: int) -> List[int]:
    """Sizes (in schedule units) of the groups, in execution order.

    groups: "auto", an int (that many near-equal groups, the larger ones first, at most one group per
    unit) or an explicit tuple that must cover the units exactly.
    """
    if groups == "auto":
        count = round(total * unit_bytes / TARGET_GROUP_BYTES)
        groups = max(1, min(total, MAX_AUTO_GROUPS, max(2, count)))
    if isinstance(groups, int):
        groups = min(groups, total)
        base, extra = divmod(total, groups)
        return [base + (i < extra) for i in range(groups)]
    sizes = list(groups)
    if sum(sizes) != total:
        raise ValueError(f"group sizes {tuple(sizes)} sum to {sum(sizes)}, the schedule has {total} units")
    return sizes


def per_peer_groups(groups, slices: int, unit_bytes: int, peers: int):
    """`groups` of one peer's region (`slices` units of `unit_bytes`) cut into transfers one peer at a time
    (ag_plan's chunks by peer, p2p_copy_plan's pushes): 'auto' aims at TARGET_GROUP_BYTES per transfer, at least
    one per peer where there are several peers (their regions follow each other, which pipelines already) and two
    where there is one; anything else is kept."""
    if groups != "auto":
        return groups
    return max(1 if peers > 1 else 2, min(slices, MAX_AUTO_GROUPS, round(slices * unit_bytes / TARGET_GROUP_BYTES)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_slice_plan(m: int, n: int, world: int, block_m: int, block_n: int, groups="auto",
                   elem_bytes: int = 2, raster_group_m: int = RASTER_GROUP_M) -> TilePlan:
    if m % world:
        raise ValueError(f"M={m} is not divisible by the group size t={world}")
    m_local = m // world
    slices, n_tiles = _cdiv(m_local, block_m), _cdiv(n, block_n)
    sizes = split_units(slices, groups, world * block_m * n * elem_bytes)
    tiles, group_tiles, collectives = [], [], []
    j0 = 0
    for g, size in enumerate(sizes):
        lo, hi = j0 * block_m, min((j0 + size) * block_m, m_local)
        rows = []   # the group's tile rows (source, source end, staging row), rastered with the N-tiles below
        for j in range(j0, j0 + size):
            for k in range(world):
                src = k * m_local + j * block_m
                rows.append((src, min(src + block_m, (k + 1) * m_local), world * lo + k * (hi - lo) + (j * block_m - lo)))
        for r, nt in raster(len(rows), n_tiles, raster_group_m):
            src, end, dst = rows[r]
            tiles.append((src, end, nt * block_n, dst, nt * block_n, g, 0, NO_WAIT, 0))
        group_tiles.append(size * world * n_tiles)
        collectives.append(Collective(world * lo, world * hi, lo, hi))
        j0 += size
    return TilePlan("row_slice", m, n, world, block_m, block_n, torch.tensor(tiles, dtype=torch.int32),
                    tuple(group_tiles), tuple(collectives), (m, n), (m_local, n), None)


def raster(m_tiles: int, n_tiles: int, group_m: int = RASTER_GROUP_M) -> List[Tuple[int, int]]:
    """Tile positions in the grouped raster order of Triton's matmul tutorial (L2-friendly)."""
    order = []
    for first_m in range(0, m_tiles, group_m):
        rows = min(group_m, m_tiles - first_m)
        for i in range(rows * n_tiles):
            order.append((first_m + i % rows, i // rows))
    return order


def tile_exact_plan(m: int, n: int, world: int, block_m: int, block_n: int, groups="auto",
                    elem_bytes: int = 2) -> TilePlan:
    if m % world:
        raise ValueError(f"M={m} is not divisible by the group size t={world}")
    m_local = m // world
    if m_local % block_m or n % block_n:
        raise ValueError(f"the tile_exact schedule needs M/t={m_local} divisible by block_m={block_m} and "
                         f"N={n} divisible by block_n={block_n}; use schedule='row_slice'")
    m_tiles, n_tiles = m_local // block_m, n // block_n
    positions = raster(m_tiles, n_tiles)
    sizes = split_units(len(positions), groups, world * block_m * block_n * elem_bytes)
    slot_of = torch.empty(m_tiles, n_tiles, dtype=torch.int32)
    tiles, group_tiles, collectives = [], [], []
    u0 = 0
    for g, size in enumerate(sizes):
        for u in range(u0, u0 + size):
            mi, ni = positions[u]
            slot_of[mi, ni] = u
            for k in range(world):
                slot = world * u0 + k * size + (u - u0)
                src = k * m_local + mi * block_m
                tiles.append((src, src + block_m, ni * block_n, slot * block_m, 0, g, 0, NO_WAIT, 0))
        group_tiles.append(size * world)
        collectives.append(Collective(world * u0 * block_m, world * (u0 + size) * block_m,
                                      u0 * block_m, (u0 + size) * block_m))
        u0 += size
    total = len(positions)
    return TilePlan("tile_exact", m, n, world, block_m, block_n, torch.tensor(tiles, dtype=torch.int32),
                    tuple(group_tiles), tuple(collectives), (world * total * block_m, block_n),
                    (total * block_m, block_n), TileOrder(block_m, block_n, slot_of))


def p2p_plan(m: int, n: int, world: int, rank: int, block_m: int, block_n: int) -> TilePlan:
    """Epilogue peer-to-peer reduce-scatter: no collective at all. Rank `rank` stores its partial of
    region k straight into rank k's receive buffer [t, M/t, N] at slot `rank` (over NVLink for k !=
    rank); after a barrier every rank sums its t slots. It is the one-group row-slice plan (every wave
    writes all regions, spreading the NVLink traffic over the whole GEMM) with its destinations moved:
    there, region k's rows sit at staging rows k*M/t + local row.

    Tile order: row-major while N has at most P2P_ROW_MAJOR_MAX_N_TILES tiles (a wave of ~132 programs
    then spans ~8 tile rows, the reuse of a raster of 8, and each tile row's stores go to one owner at a
    time, which measured faster than the rastered order's interleaving on the 8B shapes: docs/performance.md).
    Wider N is rastered in groups of 8 tile rows: row-major, a wave there spans only 132 / n_tiles rows and
    streams all of W from HBM in every wave (70B fc2: 235 MB of W per wave).

    The row-slice plan visits each slice's regions 0, 1, ..., t-1; here position k of every slice takes region
    (rank + 1 + k) % t instead: the owners in ring order, our own last (as RegionGemms). With every rank at the same
    pace, each owner then receives one rank's tile row at a time (in region order all t-1 senders stored into the same
    owner at once), and each slice ends with local stores."""
    n_tiles = _cdiv(n, block_n)
    raster_group_m = 1 if n_tiles <= P2P_ROW_MAJOR_MAX_N_TILES else RASTER_GROUP_M
    plan = row_slice_plan(m, n, world, block_m, block_n, groups=1, raster_group_m=raster_group_m)
    m_local = m // world
    tiles = plan.tiles.clone()
    position = tiles[:, SRC_ROW] // m_local                   # k: the region the row-slice plan gave this tile
    shift = ((position + rank + 1) % world - position) * m_local
    for field in (SRC_ROW, SRC_ROW_END, DST_ROW):             # the same rows of region (rank + 1 + k) % t
        tiles[:, field] += shift
    tiles[:, DST_BUF] = tiles[:, DST_ROW] // m_local
    tiles[:, DST_ROW] = rank * m_local + tiles[:, DST_ROW] % m_local
    return dataclasses.replace(plan, schedule="p2p", tiles=tiles, collectives=())


def p2p_copy_plan(m: int, n: int, world: int, rank: int, block_m: int, block_n: int, groups="auto",
                  elem_bytes: int = 2) -> TilePlan:
    """Copy-engine peer-to-peer reduce-scatter (OverlapConfig.rs_transfer 'copy'): rank `rank` stores its partials of
    the peers' regions locally, one region after another, and the copy engines push each run of rows to its owner as
    soon as its tiles are stored; its own region's partial goes straight into its own receive buffer, last.

    Execution order: the peers' regions in ring order (ring_peers: rank+1 first), each in `groups` runs of
    row-slices (one group each; 'auto': ~16 MB per run, at least one per peer where t > 2 and two at t = 2, where the
    own region alone is left to hide the last push), then the own region (the last group, which no push waits on).
    Within a run, tiles row-major, or rastered where N is wide (p2p_plan's rule).
    Destinations: the peer at ring position i stores into staging rows [i*M/t, (i+1)*M/t) (DST_BUF 0, the staging
    matrix [(t-1)*M/t, N] the kernel is given); the own region into rows [rank*M/t, (rank+1)*M/t) of buffer 1 (the
    receive buffer's slot `rank`, addressed by its offset from the staging matrix). `collectives[g]` of a push
    group holds its region rows (local rows [lo, hi), source staging rows [src_lo, src_hi)) and `chunk_peers[g]` its
    owner; the own group's entry is (lo, hi) of the whole region with owner `rank`."""
    if m % world:
        raise ValueError(f"M={m} is not divisible by the group size t={world}")
    m_local = m // world
    slices, n_tiles = _cdiv(m_local, block_m), _cdiv(n, block_n)
    raster_group_m = 1 if n_tiles <= P2P_ROW_MAJOR_MAX_N_TILES else RASTER_GROUP_M
    peers = ring_peers(rank, world)
    unit_bytes = block_m * n * elem_bytes
    sizes = split_units(slices, per_peer_groups(groups, slices, unit_bytes, len(peers)), unit_bytes)
    tiles, group_tiles, collectives, chunk_peers = [], [], [], []

    def run_tiles(region, j0, j1, dst_first_row, dst_buf, group):
        rows = [(region * m_local + j * block_m, min(region * m_local + (j + 1) * block_m, (region + 1) * m_local),
                 dst_first_row + j * block_m) for j in range(j0, j1)]
        return [(src, end, nt * block_n, dst, nt * block_n, group, dst_buf, NO_WAIT, 0)
                for r, nt in raster(len(rows), n_tiles, raster_group_m) for src, end, dst in [rows[r]]]

    for position, peer in enumerate(peers):
        j0 = 0
        for size in sizes:
            run = run_tiles(peer, j0, j0 + size, position * m_local, 0, len(group_tiles))
            tiles += run
            group_tiles.append(len(run))
            lo, hi = j0 * block_m, min((j0 + size) * block_m, m_local)
            collectives.append(Collective(position * m_local + lo, position * m_local + hi, lo, hi))
            chunk_peers.append(peer)
            j0 += size
    own = run_tiles(rank, 0, slices, rank * m_local, 1, len(group_tiles))
    tiles += own
    group_tiles.append(len(own))
    collectives.append(Collective(rank * m_local, (rank + 1) * m_local, 0, m_local))
    chunk_peers.append(rank)
    return TilePlan("p2p_copy", m, n, world, block_m, block_n, torch.tensor(tiles, dtype=torch.int32),
                    tuple(group_tiles), tuple(collectives), (max(1, world - 1) * m_local, n), (m_local, n), None,
                    tuple(chunk_peers))


def ring_peers(rank: int, t: int) -> List[int]:
    """The peers of `rank` in ring order, rank+1 first: when every rank sends to (or reads from) its peers in this
    order, no rank is the target of two ranks at once."""
    return [(rank + i) % t for i in range(1, t)]


def ag_plan(m: int, n: int, k: int, world: int, rank: int, block_m: int, block_n: int, groups="auto",
            elem_bytes: int = 2, chunk_by: str = "rows") -> TilePlan:
    """AllGather+GEMM on rank `rank`: C[M, N] = gathered A[M, K] @ W.T, rows in the standard order.

    The local region's tiles come first and wait for nothing. The peers' rows arrive in chunks. chunk_by 'rows':
    chunk c is the same run of row-slices [j0, j1) (local rows [lo, hi)) of every peer region; its tiles, in
    peer order rank+1, rank+2, ..., wait on ready flag c. chunk_by 'peer': the peers in that order, each region
    in runs of row-slices, chunk c one run of one peer (`chunk_peers[c]`), `groups` runs per peer. A tile's
    rows never cross a region, so no tile reads rows of a chunk that has not arrived (a tile's load box may
    overhang into the next region; those rows are masked out of the store and never used). `collectives[c]`
    holds the chunk's local row range (within its regions) as (lo, hi, lo, hi); `group_tiles[c]` counts the
    tiles that wait on it.
    """
    if chunk_by not in ("rows", "peer"):
        raise ValueError(f"ag_plan: chunk_by {chunk_by!r}: expected 'rows' or 'peer'")
    if m % world:
        raise ValueError(f"M={m} is not divisible by the group size t={world}")
    m_local = m // world
    slices, n_tiles = _cdiv(m_local, block_m), _cdiv(n, block_n)

    def region_tiles(regions, j0, j1, wait):
        rows = [(p * m_local + j * block_m, min(p * m_local + (j + 1) * block_m, (p + 1) * m_local))
                for p in regions for j in range(j0, j1)]
        return [(src, end, nt * block_n, src, nt * block_n, 0, 0, wait, 0)
                for r, nt in raster(len(rows), n_tiles) for src, end in [rows[r]]]

    tiles = region_tiles([rank], 0, slices, NO_WAIT)
    group_tiles, collectives, chunk_peers = [], [], []
    peers = ring_peers(rank, world)
    if peers:
        # 'rows': each chunk spans every peer region; 'peer': each chunk one region
        runs = [(peers, None)] if chunk_by == "rows" else [([p], p) for p in peers]
        unit_bytes = len(runs[0][0]) * block_m * k * elem_bytes
        if chunk_by == "peer":
            groups = per_peer_groups(groups, slices, unit_bytes, len(peers))
        sizes = split_units(slices, groups, unit_bytes)
        for regions, peer in runs:
            j0 = 0
            for size in sizes:
                chunk = region_tiles(regions, j0, j0 + size, len(group_tiles))
                tiles += chunk
                group_tiles.append(len(chunk))
                lo, hi = j0 * block_m, min((j0 + size) * block_m, m_local)
                collectives.append(Collective(lo, hi, lo, hi))
                chunk_peers.append(peer)
                j0 += size
    return TilePlan("ag", m, n, world, block_m, block_n, torch.tensor(tiles, dtype=torch.int32),
                    tuple(group_tiles), tuple(collectives), (m, n), (m, n), None,
                    None if chunk_by == "rows" else tuple(chunk_peers))


def make_plan(schedule: str, m: int, n: int, world: int, block_m: int, block_n: int, groups="auto",
              elem_bytes: int = 2) -> TilePlan:
    build = {"row_slice": row_slice_plan, "tile_exact": tile_exact_plan}[schedule]
    return build(m, n, world, block_m, block_n, groups, elem_bytes)
