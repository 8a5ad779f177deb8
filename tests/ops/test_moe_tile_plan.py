"""Expert-parallel plans against brute force: the ranks' exchanges are simulated on labelled rows, the
grouped GEMM's tiles on element write counts, for random and extreme token-count matrices."""
import random

import pytest
import torch

from overlap_tp.ops.moe_tile_plan import (EXPERT_RASTER_M, OUTPUT, STAGING, combine_plan, dispatch_plan, layout,
                                          part_bounds, parts_per_peer, pulled_rows, pushed_rows)
from overlap_tp.kernels.signaled_gemm import RowTiles
from overlap_tp.ops.tile_plan import (COL, DST_BUF, DST_COL, DST_ROW, GROUP, MAX_AUTO_GROUPS, NO_WAIT, RASTER_GROUP_M,
                                      SRC_ROW, SRC_ROW_END, TARGET_GROUP_BYTES, TILE_FIELDS, EXPERT, WAIT, raster)

N, BLOCK_N = 20, 8   # 3 N-tiles, the last one partial


def count_matrices(ep, experts, seed):
    """Random counts (zeros included), one hot expert, all tokens on one rank, a rank with no tokens, a
    rank that receives nothing, nothing at all."""
    g = torch.Generator().manual_seed(seed)
    E = ep * experts
    rand = torch.randint(0, 20, (ep, E), generator=g) * (torch.rand(ep, E, generator=g) > 0.2)
    hot = torch.randint(0, 3, (ep, E), generator=g)
    hot[:, E // 2] = 45
    one_rank = torch.zeros(ep, E, dtype=torch.int64)
    one_rank[ep // 2] = torch.randint(1, 15, (E,), generator=g)
    no_tokens = rand.clone()
    no_tokens[-1] = 0
    receives_nothing = rand.clone()
    receives_nothing[:, :experts] = 0
    return [rand, hot, one_rank, no_tokens, receives_nothing, torch.zeros(ep, E, dtype=torch.int64)]


def routed(counts, rank):
    """Brute force: rank's received rows as token labels s * 10**6 + (row of x_s), source rank major,
    local expert minor; x_s is sorted by global expert."""
    ep, E = counts.shape
    experts = E // ep
    labels = []
    for s in range(ep):
        for e in range(rank * experts, (rank + 1) * experts):
            start = int(counts[s, :e].sum())
            labels += [s * 10 ** 6 + start + i for i in range(int(counts[s, e]))]
    return labels


def segment_of(lay):
    """For every received row: (index of its (source, expert) segment, local expert)."""
    owner = [None] * lay.rows
    for k, p in enumerate(lay.segments):
        for row in range(p.src_lo, p.src_hi):
            owner[row] = (k, p.expert)
    return owner


def check_tiles(plan, dst_shapes, owner):
    """Every tile reads rows of one segment and its expert's weight rows; returns the element write counts
    of every destination buffer and, per tile, (its source rows, destination buffer, destination rows)."""
    writes = [torch.zeros(shape, dtype=torch.int64) for shape in dst_shapes]
    stores = []
    expanded = plan.tiles.expanded(plan.block_n).tolist()
    assert plan.num_tiles == len(expanded) == plan.tiles.num_tiles   # the plan's count, without the table
    for tile in expanded:
        src, end = tile[SRC_ROW], tile[SRC_ROW_END]
        assert 0 < end - src <= plan.block_m and tile[COL] == tile[DST_COL] and 0 <= tile[COL] < N
        assert tile[COL] % BLOCK_N == 0
        segment, expert = owner[src]
        assert owner[end - 1] == (segment, expert), "tile straddles two segments"
        assert tile[EXPERT] == expert
        dst = tile[DST_ROW]
        writes[tile[DST_BUF]][dst:dst + end - src, tile[COL]:tile[COL] + BLOCK_N] += 1
        stores.append((src, end, tile[DST_BUF], dst, tile))
    return writes, stores


def check_parts(plan, counts, rank, direction):
    """Each remote block is split into parts of whole row tiles, the tile counts differing by at most one;
    group/chunk g holds part g of every remote block (a tile of every peer whose block has >= P tiles)."""
    lay = plan.layout
    ep, experts = lay.ep, lay.experts
    for peer in range(ep):
        if peer == rank:
            continue
        src, dst = (peer, rank) if direction == "in" else (rank, peer)
        rows = counts[src, dst * experts:(dst + 1) * experts].tolist()
        bounds = part_bounds(rows, plan.block_m, plan.parts)
        starts = [sum(rows[:l]) + j for l in range(experts) for j in range(0, rows[l], plan.block_m)]
        per_part = [sum(bounds[c] <= s < bounds[c + 1] for s in starts) for c in range(plan.parts)]
        assert sum(per_part) == len(starts) and max(per_part) - min(per_part) <= 1
        assert per_part == sorted(per_part, reverse=True)
        assert all(b in starts or b == sum(rows) for b in bounds[1:-1]), "a part boundary inside a row tile"


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("experts", [1, 2, 3, 4])
def test_dispatch_plan_delivers_every_row_before_its_tiles_read_it(ep, experts):
    rng = random.Random(ep * 10 + experts)
    for m, counts in enumerate(count_matrices(ep, experts, seed=ep * 100 + experts)):
        block_m, parts = rng.choice([4, 8]), rng.choice([1, 2, 3])
        tokens = [[s * 10 ** 6 + i for i in range(int(counts[s].sum()))] for s in range(ep)]
        plans = [dispatch_plan(layout(counts, r), N, block_m, BLOCK_N, parts) for r in range(ep)]
        received = [[None] * p.layout.rows for p in plans]
        arrival = [[None] * p.layout.rows for p in plans]   # -1: the local copy, c: chunk c
        for r, plan in enumerate(plans):
            lay = plan.layout
            assert lay.tokens == len(tokens[r]) and lay.rows == len(routed(counts, r))
            assert list(lay.x_splits) == [int(counts[r, d * experts:(d + 1) * experts].sum()) for d in range(ep)]
            assert list(lay.xr_splits) == [int(counts[s, r * experts:(r + 1) * experts].sum()) for s in range(ep)]
            lo, hi, dst = plan.local
            for i in range(lo, hi):
                received[r][dst + i - lo], arrival[r][dst + i - lo] = tokens[r][i], -1
            assert len(plan.exchanges) == (parts if ep > 1 else 0)
        for c in range(parts if ep > 1 else 0):
            for r, plan in enumerate(plans):
                for peer, lo, hi in plan.exchanges[c].sends:
                    match = [(a, b) for p, a, b in plans[peer].exchanges[c].recvs if p == r]
                    assert len(match) == 1 and match[0][1] - match[0][0] == hi - lo, "sizes differ at the two ends"
                    for i in range(hi - lo):
                        row = match[0][0] + i
                        assert received[peer][row] is None, "received twice"
                        received[peer][row], arrival[peer][row] = tokens[r][lo + i], c
        for r, plan in enumerate(plans):
            assert received[r] == routed(counts, r), (m, r)
            writes, stores = check_tiles(plan, [(plan.layout.rows, N)], segment_of(plan.layout))
            assert plan.layout.rows == 0 or (int(writes[0].min()) == 1 and int(writes[0].max()) == 1), (m, r)
            waits = plan.tiles.expanded(BLOCK_N)[:, WAIT].tolist()
            local = waits.count(NO_WAIT)
            assert all(w == NO_WAIT for w in waits[:local]) and waits[local:] == sorted(waits[local:])
            assert list(plan.group_tiles) == [waits.count(c) for c in range(len(plan.exchanges))]
            for src, end, buf, dst, tile in stores:
                assert buf == 0 and dst == src and tile[GROUP] == 0
                assert max(arrival[r][src:end]) <= (tile[WAIT] if tile[WAIT] != NO_WAIT else -1), \
                    "a tile reads rows before they arrive"
            check_parts(plan, counts, r, "in")
            check_parts(plan, counts, r, "out")


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("experts", [1, 2, 3, 4])
def test_combine_plan_returns_every_row_to_its_token(ep, experts):
    rng = random.Random(ep * 10 + experts + 1)
    for m, counts in enumerate(count_matrices(ep, experts, seed=ep * 100 + experts + 1)):
        block_m, parts = rng.choice([4, 8]), rng.choice([1, 2, 3])
        plans = [combine_plan(layout(counts, r), N, block_m, BLOCK_N, parts) for r in range(ep)]
        z = [[None] * p.layout.tokens for p in plans]
        staged = []
        for r, plan in enumerate(plans):
            lay = plan.layout
            labels = routed(counts, r)   # the GEMM output of received row j belongs to token labels[j]
            assert plan.staging_rows == lay.rows - lay.xr_splits[r]
            writes, stores = check_tiles(plan, [(plan.staging_rows, N), (lay.tokens, N)], segment_of(lay))
            assert all(bool((w <= 1).all()) for w in writes), "an element written twice"
            assert plan.staging_rows == 0 or int(writes[STAGING].min()) == 1, "a staging row not computed"
            local_rows = writes[OUTPUT].sum(1) > 0
            assert int(local_rows.sum()) == lay.xr_splits[r] and bool((writes[OUTPUT][local_rows] == 1).all())
            groups = plan.tiles.expanded(BLOCK_N)[:, GROUP].tolist()
            assert groups == sorted(groups) and list(plan.group_tiles) == [groups.count(g) for g in
                                                                           range(len(plan.group_tiles))]
            staging, group_of = [None] * plan.staging_rows, [None] * plan.staging_rows
            for src, end, buf, dst, tile in stores:
                for i in range(end - src):
                    if buf == OUTPUT:   # the local rows, stored straight into z at their token's row
                        assert tile[GROUP] == len(plan.exchanges) and labels[src + i] // 10 ** 6 == r
                        z[r][dst + i] = labels[src + i]
                    else:
                        staging[dst + i], group_of[dst + i] = labels[src + i], tile[GROUP]
            for g, exchange in enumerate(plan.exchanges):
                for peer, lo, hi in exchange.sends:
                    assert set(group_of[lo:hi]) == {g}, "an exchange sends rows of another group"
            staged.append(staging)
        for g in range(parts if ep > 1 else 0):
            for r, plan in enumerate(plans):
                for peer, lo, hi in plan.exchanges[g].sends:
                    match = [(a, b) for p, a, b in plans[peer].exchanges[g].recvs if p == r]
                    assert len(match) == 1 and match[0][1] - match[0][0] == hi - lo, "sizes differ at the two ends"
                    for i in range(hi - lo):
                        assert z[peer][match[0][0] + i] is None, "received twice"
                        z[peer][match[0][0] + i] = staged[r][lo + i]
        for r, plan in enumerate(plans):
            assert z[r] == [r * 10 ** 6 + i for i in range(plan.layout.tokens)], (m, r)
            check_parts(plan, counts, r, "in")


def test_groups_hold_every_peer():
    """Uniform routing: each of the P groups holds a part of every remote peer, near-equal in tiles."""
    ep, experts = 4, 2
    counts = torch.full((ep, ep * experts), 40, dtype=torch.int64)
    for r in range(ep):
        for make in (dispatch_plan, combine_plan):
            plan = make(layout(counts, r), N, 8, BLOCK_N, 3)
            groups = plan.gemm_groups[1:] if make is dispatch_plan else plan.gemm_groups[:-1]
            assert len(groups) == 3
            for pieces in groups:
                peers = {p.src_lo // (experts * 40) for p in pieces}
                assert peers == set(range(ep)) - {r}
            sizes = [sum(-(-(p.src_hi - p.src_lo) // 8) for p in pieces) for pieces in groups]
            assert max(sizes) - min(sizes) <= ep - 1


def test_parts_per_peer():
    counts = torch.zeros(2, 4, dtype=torch.int64)
    counts[0, 2:] = 2048          # rank 0 sends 4096 rows of 8 KB (32 MB) to rank 1
    assert parts_per_peer(counts, "auto", 8192) == 2
    counts[0, 2:] = 8192          # 128 MB: 8 groups
    assert parts_per_peer(counts, "auto", 8192) == 8
    counts[0, 2:] = 1 << 20       # capped
    assert parts_per_peer(counts, "auto", 8192) == MAX_AUTO_GROUPS
    counts[0, 2:] = 3 * TARGET_GROUP_BYTES // 8192 // 2
    assert parts_per_peer(counts, "auto", 8192) == 3
    counts.fill_(0)
    counts[0, :2] = counts[1, 2:] = 1 << 20   # only local rows: nothing to split, the floor of 2 is harmless
    assert parts_per_peer(counts, "auto", 8192) == 2
    assert parts_per_peer(counts, 5, 8192) == 5
    with pytest.raises(ValueError, match="parts per peer"):
        parts_per_peer(counts, (1, 2), 8192)


def test_part_bounds():
    assert part_bounds([10], 4, 2) == [0, 8, 10]            # tiles [0,4) [4,8) [8,10): 2 + 1
    assert part_bounds([3, 5], 4, 2) == [0, 7, 8]           # tiles [0,3) [3,7) [7,8)
    assert part_bounds([0, 0], 4, 3) == [0, 0, 0, 0]
    assert part_bounds([2], 4, 3) == [0, 2, 2, 2]           # one tile, two empty parts


def test_row_tiles_expand_in_plan_raster_order_within_each_group():
    # groups of 0, 1, 3, 8, 17 and 16 row tiles: each group's tiles are its (row tile, N-tile) pairs in
    # tile_plan.raster's order, the groups one after another (what the kernel's ROW_TILES mode walks)
    for n_tiles, raster_m in ((1, RASTER_GROUP_M), (3, RASTER_GROUP_M), (5, 4), (16, RASTER_GROUP_M),
                              (3, EXPERT_RASTER_M)):
        sizes = [0, 1, 3, 8, 17, 16, 40]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        rows = torch.zeros(starts[-1], TILE_FIELDS, dtype=torch.int32)
        rows[:, SRC_ROW] = torch.arange(starts[-1], dtype=torch.int32)     # row tile r's own index
        table = RowTiles(rows, torch.tensor(starts, dtype=torch.int32), n_tiles, raster_m)
        expanded = table.expanded(BLOCK_N)
        want = [(starts[g] + r, c * BLOCK_N) for g, size in enumerate(sizes)
                for r, c in raster(size, n_tiles, raster_m)]
        assert list(zip(expanded[:, SRC_ROW].tolist(), expanded[:, COL].tolist())) == want
        assert expanded[:, DST_COL].tolist() == expanded[:, COL].tolist()
        assert table.num_tiles == len(want) and table.group_tiles() == [size * n_tiles for size in sizes]
        assert table.max_groups >= table.num_groups and table.max_groups & (table.max_groups - 1) == 0


def test_layout_segments():
    counts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    lay = layout(counts, 1)
    assert (lay.tokens, lay.rows, lay.x_splits, lay.xr_splits, lay.x_offsets, lay.xr_offsets) == \
        (26, 22, (11, 15), (7, 15), (0, 11), (0, 7))
    assert [(p.src_lo, p.src_hi, p.expert) for p in lay.segments] == [(0, 3, 0), (3, 7, 1), (7, 14, 0), (14, 22, 1)]


@pytest.mark.parametrize("ep, experts", [(2, 2), (3, 1), (4, 3), (8, 2)])
def test_p2p_copies_are_the_rows_each_peer_sends_and_receives(ep, experts):
    """The expert ops' p2p transport addresses the peer's memory from its own plan alone: a pulled part (dispatch) must
    be, row for row, what the peer's exchange sends here, and a pushed part (combine) what the peer's exchange
    receives from here; and, brute force, the pulled rows are the tokens this rank's xr holds at those rows."""
    for m, counts in enumerate(count_matrices(ep, experts, seed=ep * 10 + experts)):
        for parts in (1, 2, 3):
            lays = [layout(counts, r) for r in range(ep)]
            dispatch = [dispatch_plan(lays[r], 64, 16, 32, parts) for r in range(ep)]
            combine = [combine_plan(lays[r], 64, 16, 32, parts) for r in range(ep)]
            for r in range(ep):
                received = routed(counts, r)
                for c, exchange in enumerate(dispatch[r].exchanges):
                    for peer, src, dst, rows in pulled_rows(lays[r], exchange):
                        assert (r, src, src + rows) in dispatch[peer].exchanges[c].sends, (m, parts, r, c, peer)
                        assert received[dst:dst + rows] == [peer * 10 ** 6 + src + i for i in range(rows)], \
                            (m, parts, r, c, peer)
                for g, exchange in enumerate(combine[r].exchanges):
                    for peer, dst, src, rows in pushed_rows(lays[r], exchange):
                        assert (r, dst, dst + rows) in combine[peer].exchanges[g].recvs, (m, parts, r, g, peer)
                # every part is copied once: the pulls cover every row received from the peers
                pulled = sum(rows for exchange in dispatch[r].exchanges for *_, rows in pulled_rows(lays[r], exchange))
                assert pulled == lays[r].rows - lays[r].xr_splits[r], (m, parts, r)
