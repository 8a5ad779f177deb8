"""Tile plans against a brute-force simulation of the GEMM epilogue and the per-group collective."""
import random

import pytest
import torch

from overlap_tp.ops.tile_plan import (COL, DST_BUF, DST_COL, DST_ROW, GROUP, NO_WAIT, SRC_ROW, SRC_ROW_END, WAIT, ag_plan,
                             make_plan, p2p_copy_plan, p2p_plan, raster, ring_peers, split_units)


def simulate(plan):
    """Store every tile of the source matrix S[r, c] = r * N + c where the plan says, check that no
    staging element is written twice and that each tile lands inside its own group's collective, then
    run each group's reduce-scatter (rank k takes block k of the group's staging rows)."""
    m, n, t = plan.m, plan.n, plan.world
    source = torch.arange(m * n, dtype=torch.int64).view(m, n)
    staging = torch.full(plan.staging_shape, -1, dtype=torch.int64)
    writes = torch.zeros(plan.staging_shape, dtype=torch.int64)
    groups = plan.tiles[:, GROUP].tolist()
    assert groups == sorted(groups), "groups must be contiguous in execution order"
    for g in range(plan.num_groups):
        assert groups.count(g) == plan.group_tiles[g]
    for tile in plan.tiles.tolist():
        rows = tile[SRC_ROW_END] - tile[SRC_ROW]
        cols = min(plan.block_n, n - tile[COL])
        assert 0 < rows <= plan.block_m and cols > 0
        assert tile[SRC_ROW] // (m // t) == (tile[SRC_ROW_END] - 1) // (m // t), "tile crosses a region"
        dst = (slice(tile[DST_ROW], tile[DST_ROW] + rows), slice(tile[DST_COL], tile[DST_COL] + cols))
        staging[dst] = source[tile[SRC_ROW]:tile[SRC_ROW_END], tile[COL]:tile[COL] + cols]
        writes[dst] += 1
        c = plan.collectives[tile[GROUP]]
        assert c.src_lo <= tile[DST_ROW] and tile[DST_ROW] + rows <= c.src_hi, "tile outside its group's collective"
    assert int(writes.max()) == 1
    outputs = []
    for k in range(t):
        out = torch.full(plan.out_shape, -1, dtype=torch.int64)
        for c in plan.collectives:
            block = staging[c.src_lo:c.src_hi]
            out[c.dst_lo:c.dst_hi] = block.view(t, -1, block.shape[1])[k]
        outputs.append(out if plan.tile_order is None else plan.tile_order.undo(out))
    return source, outputs


CASES = [  # (m, n, t, block_m, block_n, groups)
    (64, 64, 1, 16, 32, "auto"), (96, 80, 2, 16, 32, 3), (200, 48, 2, 16, 16, (2, 3, 2)),
    (128, 64, 4, 16, 32, 2), (8 * 40, 100, 8, 16, 32, "auto"), (4 * 33, 17, 4, 16, 16, 1),
    (2 * 7, 30, 2, 16, 16, "auto"), (512, 256, 2, 32, 64, 5),
]


@pytest.mark.parametrize("m,n,t,bm,bn,groups", CASES)
def test_row_slice_lands_in_standard_layout(m, n, t, bm, bn, groups):
    plan = make_plan("row_slice", m, n, t, bm, bn, groups)
    source, outputs = simulate(plan)
    for k, out in enumerate(outputs):
        assert torch.equal(out, source[k * m // t:(k + 1) * m // t]), f"rank {k}"


@pytest.mark.parametrize("m,n,t,bm,bn,groups", [c for c in CASES if (c[0] // c[2]) % c[3] == 0 and c[1] % c[4] == 0])
def test_tile_exact_round_trips(m, n, t, bm, bn, groups):
    plan = make_plan("tile_exact", m, n, t, bm, bn, groups)
    source, outputs = simulate(plan)
    for k, out in enumerate(outputs):
        assert torch.equal(out, source[k * m // t:(k + 1) * m // t]), f"rank {k}"
    assert plan.tile_order.shape == (m // t, n)


def test_random_shapes():
    rng = random.Random(0)
    for _ in range(40):
        t = rng.choice([1, 2, 4, 8])
        bm, bn = rng.choice([16, 32]), rng.choice([16, 32, 64])
        m_local = rng.choice([bm * rng.randint(1, 9), rng.randint(1, 150)])
        n = rng.choice([bn * rng.randint(1, 5), rng.randint(1, 130)])
        schedule = "tile_exact" if m_local % bm == 0 and n % bn == 0 and rng.random() < 0.5 else "row_slice"
        units = -(-m_local // bm) if schedule == "row_slice" else (m_local // bm) * (n // bn)
        groups = rng.choice(["auto", rng.randint(1, units)])
        plan = make_plan(schedule, m_local * t, n, t, bm, bn, groups)
        source, outputs = simulate(plan)
        for k, out in enumerate(outputs):
            assert torch.equal(out, source[k * m_local:(k + 1) * m_local]), (schedule, m_local, n, t, bm, bn, groups)


def test_raster_visits_every_tile_once():
    for m_tiles, n_tiles in [(1, 1), (3, 5), (8, 4), (17, 3), (16, 16)]:
        order = raster(m_tiles, n_tiles)
        assert sorted(order) == [(i, j) for i in range(m_tiles) for j in range(n_tiles)]


def test_split_units():
    assert split_units(10, 3, 1) == [4, 3, 3]
    assert split_units(10, (1, 9), 1) == [1, 9]
    assert split_units(64, "auto", 1 << 20) == [16] * 4         # 64 MB in 16 MB groups
    assert split_units(256, "auto", 1 << 20) == [32] * 8        # 256 MB: capped at 8 groups
    assert split_units(64, "auto", 1 << 10) == [32, 32]         # tiny output still gets 2 groups
    assert split_units(1, "auto", 1 << 30) == [1]
    with pytest.raises(ValueError, match="sum to"):
        split_units(10, (3, 3), 1)
    assert split_units(3, 5, 1) == [1, 1, 1]                    # at most one group per unit


def test_plan_errors():
    with pytest.raises(ValueError, match="not divisible by the group size"):
        make_plan("row_slice", 10, 16, 4, 16, 16)
    with pytest.raises(ValueError, match="tile_exact schedule needs"):
        make_plan("tile_exact", 2 * 24, 32, 2, 16, 16)


@pytest.mark.parametrize("m,n,t,bm,bn", [(96, 80, 2, 16, 32), (4 * 33, 17, 4, 16, 16), (8 * 40, 100, 8, 16, 32),
                                         (2 * 16 * 19, 16 * 40 + 8, 2, 16, 16)])   # > 16 N-tiles: rastered order
def test_p2p_plan_delivers_every_partial_to_its_owner(m, n, t, bm, bn):
    """Every rank stores region k of its partial into rank k's receive buffer, slot = its own rank:
    after all ranks ran, buffer k slot r holds rank r's rows of region k, each element written once."""
    m_local = m // t
    received = torch.full((t, t * m_local, n), -1, dtype=torch.int64)
    for rank in range(t):
        plan = p2p_plan(m, n, t, rank, bm, bn)
        assert plan.num_groups == 1 and plan.group_tiles == (plan.num_tiles,)
        source = torch.arange(m * n, dtype=torch.int64).view(m, n) + rank * m * n   # rank's own partial
        for tile in plan.tiles.tolist():
            rows, cols = tile[SRC_ROW_END] - tile[SRC_ROW], min(bn, n - tile[COL])
            region = tile[SRC_ROW] // m_local
            assert tile[DST_BUF] == region
            dst = received[region, tile[DST_ROW]:tile[DST_ROW] + rows, tile[DST_COL]:tile[DST_COL] + cols]
            assert (dst == -1).all(), "written twice"
            dst.copy_(source[tile[SRC_ROW]:tile[SRC_ROW_END], tile[COL]:tile[COL] + cols])
    for k in range(t):
        for r in range(t):
            expected = torch.arange(m * n, dtype=torch.int64).view(m, n)[k * m_local:(k + 1) * m_local] + r * m * n
            assert torch.equal(received[k, r * m_local:(r + 1) * m_local], expected)


def test_p2p_plan_order_is_row_major_up_to_16_n_tiles_then_rastered():
    def tile_rows_of_first(plan, count):
        return [tile[SRC_ROW] for tile in plan.tiles[:count].tolist()]
    narrow = p2p_plan(2 * 16 * 20, 16 * 16, 2, 0, 16, 16)
    assert tile_rows_of_first(narrow, 16) == [320] * 16                      # one tile row after the other
    wide = p2p_plan(2 * 16 * 20, 16 * 17, 2, 0, 16, 16)
    assert len(set(tile_rows_of_first(wide, 8))) == 8                        # 8 tile rows share each N-tile


@pytest.mark.parametrize("t, n", [(2, 16 * 16), (4, 16 * 16), (4, 16 * 17), (8, 16 * 40)])
def test_p2p_plan_stores_to_the_owners_in_ring_order(t, n):
    """Each row slice's regions in ring order, rank+1's first and our own last: at every step of the tile list (ranks
    advancing at the same pace) the t ranks store into t distinct owners, and rank r's owner is rank 0's plus r."""
    m = t * 16 * 20
    plans = [p2p_plan(m, n, t, rank, 16, 16) for rank in range(t)]
    owners = [plan.tiles[:, DST_BUF] for plan in plans]
    for rank in range(t):
        assert torch.equal(owners[rank], (owners[0] + rank) % t)
    assert all(len(set(step)) == t for step in torch.stack(owners, 1).tolist())
    slice_of = plans[0].tiles[:, SRC_ROW] % (m // t) // 16
    for j in range(20):   # within a slice (row-major or rastered), rank 0 reaches its own region last
        seq = owners[0][slice_of == j].tolist()
        firsts = [seq.index((1 + i) % t) for i in range(t)]   # ring order: 1, 2, ..., t-1, then 0
        assert firsts == sorted(firsts) and seq[0] == 1 % t and seq[-1] == 0


@pytest.mark.parametrize("m,n,t,bm,bn,groups", [(96, 80, 2, 16, 32, "auto"), (4 * 33, 17, 4, 16, 16, 2),
                                                (8 * 40, 100, 8, 16, 32, "auto"), (2 * 16 * 19, 16 * 40 + 8, 2, 16, 16, 3),
                                                (4 * 16 * 7, 48, 4, 16, 16, (3, 4)), (3 * 50, 64, 3, 16, 32, 1)])
def test_p2p_copy_plan_delivers_every_partial_through_its_push(m, n, t, bm, bn, groups):
    """rs_transfer 'copy': every rank stores its partial of the peers' regions into the staging matrix and its own
    region into its own slot; each push group g then copies staging rows [src_lo, src_hi) into rows dst_lo.. of slot
    `rank` of its owner's buffer. Brute force: after every rank's tiles and pushes, buffer k slot r holds rank r's
    rows of region k, every element stored once; the groups run peer by peer in ring order, our own region last and
    pushed nowhere; each push's rows are exactly its group's stores."""
    m_local = m // t
    received = torch.full((t, t * m_local, n), -1, dtype=torch.int64)
    for rank in range(t):
        plan = p2p_copy_plan(m, n, t, rank, bm, bn, groups)
        pushes = plan.num_groups - 1
        source = torch.arange(m * n, dtype=torch.int64).view(m, n) + rank * m * n   # rank's own partial
        staging = torch.full(plan.staging_shape, -1, dtype=torch.int64)
        stored_rows = [set() for _ in range(plan.num_groups)]
        tile_groups = plan.tiles[:, GROUP].tolist()
        assert tile_groups == sorted(tile_groups), "groups contiguous in execution order"
        assert [tile_groups.count(g) for g in range(plan.num_groups)] == list(plan.group_tiles)
        for tile in plan.tiles.tolist():
            rows, cols = tile[SRC_ROW_END] - tile[SRC_ROW], min(bn, n - tile[COL])
            region, g = tile[SRC_ROW] // m_local, tile[GROUP]
            assert (tile[SRC_ROW_END] - 1) // m_local == region, "a tile's rows never cross a region"
            assert plan.chunk_peers[g] == region and tile[WAIT] == NO_WAIT
            if region == rank:   # the own region: straight into slot `rank` of our own buffer (DST_BUF 1)
                assert tile[DST_BUF] == 1 and g == pushes
                dst = received[rank, tile[DST_ROW]:tile[DST_ROW] + rows, tile[DST_COL]:tile[DST_COL] + cols]
            else:
                assert tile[DST_BUF] == 0 and g < pushes
                dst = staging[tile[DST_ROW]:tile[DST_ROW] + rows, tile[DST_COL]:tile[DST_COL] + cols]
                stored_rows[g].update(range(tile[DST_ROW], tile[DST_ROW] + rows))
            assert (dst == -1).all(), "written twice"
            dst.copy_(source[tile[SRC_ROW]:tile[SRC_ROW_END], tile[COL]:tile[COL] + cols])
        assert [plan.chunk_peers[g] for g in range(plan.num_groups)] == sorted(
            plan.chunk_peers, key=lambda p: (p - rank - 1) % t), "ring order, our own region last"
        assert plan.chunk_peers[-1] == rank and set(plan.chunk_peers[:pushes]) == set(ring_peers(rank, t))
        for g in range(pushes):
            c, owner = plan.collectives[g], plan.chunk_peers[g]
            assert stored_rows[g] == set(range(c.src_lo, c.src_hi)), f"push {g} copies exactly its group's rows"
            target = received[owner, rank * m_local + c.dst_lo:rank * m_local + c.dst_hi]
            assert (target == -1).all()
            target.copy_(staging[c.src_lo:c.src_hi])
    for k in range(t):
        for r in range(t):
            expected = torch.arange(m * n, dtype=torch.int64).view(m, n)[k * m_local:(k + 1) * m_local] + r * m * n
            assert torch.equal(received[k, r * m_local:(r + 1) * m_local], expected)


def test_p2p_copy_plan_pushes_one_region_per_peer_at_the_8b_shapes_where_t_exceeds_2():
    """'auto' pushes: ~16 MB each, at least one per peer where t > 2 (the 8B proj at t = 4: 16 MB regions, one push
    each) and two at t = 2 (the own region alone would hide the only push's tail)."""
    assert p2p_copy_plan(8192, 4096, 4, 1, 128, 256).num_groups == 3 + 1
    assert p2p_copy_plan(8192, 4096, 2, 0, 128, 256).num_groups == 2 + 1
    assert p2p_copy_plan(8192, 8192, 4, 0, 128, 256).num_groups == 3 * 2 + 1   # 70B proj: 32 MB regions


@pytest.mark.parametrize("m,n,t,bm,bn,groups", CASES)
def test_ag_plan_by_peers_waits_for_one_peers_rows_per_chunk(m, n, t, bm, bn, groups):
    """chunk_by 'peer': the same tiles as chunk_by 'rows' (each output tile once, from its own rows, local ones first
    with no wait), but chunk c carries rows of one peer only (chunk_peers[c]), the peers in ring order, `groups`
    chunks per peer covering its region; a tile waits on the chunk of its own peer and rows."""
    m_local = m // t
    for rank in range(t):
        plan = ag_plan(m, n, 64, t, rank, bm, bn, groups, chunk_by="peer")
        rows = ag_plan(m, n, 64, t, rank, bm, bn, groups)
        assert rows.chunk_peers is None
        assert sorted(tuple(tile[:WAIT] + tile[WAIT + 1:]) for tile in plan.tiles.tolist()) == sorted(
            tuple(tile[:WAIT] + tile[WAIT + 1:]) for tile in rows.tiles.tolist()), "the same tiles"
        peers = [(rank + i) % t for i in range(1, t)]
        if t == 1:
            assert plan.chunk_peers == () and plan.group_tiles == ()
            continue
        per_peer = len(plan.chunk_peers) // (t - 1)
        assert list(plan.chunk_peers) == [p for p in peers for _ in range(per_peer)], "ring order, whole regions"
        if isinstance(groups, int):
            assert per_peer == min(groups, -(-m_local // bm))
        for p in peers:
            spans = [plan.collectives[c] for c in range(len(plan.chunk_peers)) if plan.chunk_peers[c] == p]
            assert spans[0].src_lo == 0 and spans[-1].src_hi == m_local
            assert all(a.src_hi == b.src_lo for a, b in zip(spans, spans[1:]))
        waits = plan.tiles[:, WAIT].tolist()
        first_wait = next((i for i, f in enumerate(waits) if f != NO_WAIT), len(waits))
        assert all(f == NO_WAIT for f in waits[:first_wait]) and waits[first_wait:] == sorted(waits[first_wait:])
        for tile in plan.tiles.tolist():
            region = tile[SRC_ROW] // m_local
            if tile[WAIT] == NO_WAIT:
                assert region == rank
            else:
                chunk = plan.collectives[tile[WAIT]]
                assert plan.chunk_peers[tile[WAIT]] == region
                assert chunk.src_lo <= tile[SRC_ROW] - region * m_local and tile[SRC_ROW_END] - region * m_local <= chunk.src_hi
        assert [int((plan.tiles[:, WAIT] == c).sum()) for c in range(plan.num_groups)] == list(plan.group_tiles)


def test_ag_plan_by_peers_sizes_auto_chunks_near_16_mb():
    """groups 'auto' with chunk_by 'peer' aims at ~16 MB per chunk of one peer: one chunk per peer at the 8B qkv shape
    at t = 4 (16 MB regions), two at the 70B's (32 MB), and at t = 2, where one chunk per peer would leave nothing
    to pipeline, at least two."""
    assert ag_plan(8192, 1536, 4096, 4, 0, 128, 256, chunk_by="peer").chunk_peers == (1, 2, 3)
    assert ag_plan(8192, 2560, 8192, 4, 0, 128, 256, chunk_by="peer").chunk_peers == (1, 1, 2, 2, 3, 3)
    assert ag_plan(8192, 3072, 4096, 2, 1, 128, 256, chunk_by="peer").chunk_peers == (0, 0)
    assert ag_plan(4096, 768, 1024, 2, 0, 128, 256, chunk_by="peer").chunk_peers == (1, 1)
    with pytest.raises(ValueError, match="chunk_by 'ring'"):
        ag_plan(4096, 768, 1024, 2, 0, 128, 256, chunk_by="ring")


@pytest.mark.parametrize("m,n,t,bm,bn,groups", CASES)
def test_ag_plan_covers_every_output_tile_after_its_rows_arrive(m, n, t, bm, bn, groups):
    """For every rank: each output element is computed exactly once, from its own rows, at its standard
    position; local rows come first and wait for nothing; a peer row is read only by tiles that wait
    on the chunk that carries it (chunks: the same local row range of every peer region)."""
    m_local = m // t
    for rank in range(t):
        plan = ag_plan(m, n, 64, t, rank, bm, bn, groups)
        written = torch.zeros(m, n, dtype=torch.int64)
        waits = plan.tiles[:, WAIT].tolist()
        first_wait = next((i for i, f in enumerate(waits) if f != NO_WAIT), len(waits))
        assert all(f == NO_WAIT for f in waits[:first_wait]) and all(f != NO_WAIT for f in waits[first_wait:])
        assert waits[first_wait:] == sorted(waits[first_wait:]), "chunks in arrival order"
        for tile in plan.tiles.tolist():
            src, end, col = tile[SRC_ROW], tile[SRC_ROW_END], tile[COL]
            region = src // m_local
            assert region == (end - 1) // m_local and 0 < end - src <= bm
            assert (tile[DST_ROW], tile[DST_COL]) == (src, col)
            if tile[WAIT] == NO_WAIT:
                assert region == rank
            else:
                chunk = plan.collectives[tile[WAIT]]
                assert region != rank and chunk.src_lo <= src - region * m_local and end - region * m_local <= chunk.src_hi
            written[src:end, col:col + bn] += 1
        assert int(written.min()) == 1 and int(written.max()) == 1
        if t > 1:
            assert plan.collectives[0].src_lo == 0 and plan.collectives[-1].src_hi == m_local
            assert all(a.src_hi == b.src_lo for a, b in zip(plan.collectives, plan.collectives[1:]))
            assert sum(plan.group_tiles) == int((plan.tiles[:, WAIT] != NO_WAIT).sum())
