"""The signaled GEMM kernel on its own, in the Triton CPU interpreter."""
import torch

from overlap_tp import OverlapConfig
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.tile_plan import make_plan, p2p_plan
from problems import staged_as_rows

CONFIG = OverlapConfig(block_m=16, block_n=32, block_k=16)


def test_counters_count_each_groups_tiles_and_the_tiles_hold_the_product():
    """Each group's counter reaches its tile count (and counts on, call after call), and what the
    kernel stored is A @ W.T: every staging element written (NaN-poisoned before), each region's rows
    where its collective reads them, within bf16 rounding of an fp64 product; a second call stores the
    same bits."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(96, 32, generator=gen).to(torch.bfloat16)
    w = torch.randn(80, 32, generator=gen).to(torch.bfloat16)
    ref = a.double() @ w.double().t()
    plan = make_plan("row_slice", 96, 80, 2, 16, 32, groups=3)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32)
    outputs = []
    for calls in (1, 2):
        staging = torch.full(plan.staging_shape, float("nan"), dtype=torch.bfloat16)
        signaled_gemm(a, w, staging, plan.tiles, counters, 3, CONFIG)
        assert counters.tolist() == [calls * g for g in plan.group_tiles]
        assert not staging.isnan().any(), "a staging element was never written"
        got = staged_as_rows(staging, plan)
        # bf16 output: each element within a few bf16 ulps of the fp64 product (K = 32, fp32 accumulation)
        assert torch.allclose(got.double(), ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max())), \
            float((got.double() - ref).abs().max())
        outputs.append(staging)
    assert torch.equal(outputs[0], outputs[1])


def test_p2p_stores_reach_every_owner():
    """t ranks emulated in one process: each rank's kernel stores region k of its partial into rank k's
    buffer (addressed as an offset from its own); summing the slots gives the reduce-scatter, with the
    bias added exactly once, on the owner's own partial."""
    t, m, n, k = 2, 2 * 40, 72, 64
    a = torch.randn(m, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    buffers = [torch.full((m, n), float("nan"), dtype=torch.bfloat16) for _ in range(t)]
    k_local = k // t
    for rank in range(t):
        shard = slice(rank * k_local, (rank + 1) * k_local)
        offsets = torch.tensor([(b.data_ptr() - buffers[rank].data_ptr()) // 2 for b in buffers], dtype=torch.int64)
        assert (offsets % 16 == 0).all()
        plan = p2p_plan(m, n, t, rank, 16, 32)
        signaled_gemm(a[:, shard].contiguous(), w[:, shard].contiguous(), buffers[rank], plan.tiles,
                      torch.zeros(1, dtype=torch.int32), 3, CONFIG, bias, (rank * m // t, (rank + 1) * m // t),
                      dst_offsets=offsets)
    dense = a.double() @ w.double().t() + bias.double()
    for rank in range(t):
        got = buffers[rank].view(t, m // t, n).sum(0)
        ref = dense[rank * m // t:(rank + 1) * m // t]
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-2


def test_transposed_weight_is_read_in_place():
    """w given as weight.t() (a dgrad's operand) gives the same tiles as its row-major copy, bit for bit:
    single weights at shapes with N and K tails, and stacked expert weights [L, K, N] read as [L, N, K]."""
    import pytest
    from overlap_tp.kernels.signaled_gemm import weight_layout
    from overlap_tp.ops.tile_plan import EXPERT
    gen = torch.Generator().manual_seed(7)
    for m, n, k in ((64, 96, 48), (40, 72, 32), (96, 40, 64)):
        a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        weight = torch.randn(k, n, generator=gen).to(torch.bfloat16)   # stored [K, N]: w = weight.t() is [N, K]
        assert weight_layout(weight.t()) == "kn" and weight_layout(weight.t().contiguous()) == "nk"
        plan = make_plan("row_slice", m, n, 1, 16, 32, groups=2)
        outs = []
        for w in (weight.t(), weight.t().contiguous()):
            staging = torch.full(plan.staging_shape, float("nan"), dtype=torch.bfloat16)
            signaled_gemm(a, w, staging, plan.tiles, None, 3, CONFIG)
            outs.append(staging)
        assert torch.equal(outs[0], outs[1]), (m, n, k)
        ref = a.double() @ weight.double()
        assert float((outs[0].double() - ref).norm() / ref.norm()) < 1e-2
    # grouped: L experts stacked [L, K, N]; tiles of rows [16 l, 16 l + 16) use expert l
    L, m, n, k = 3, 48, 40, 32
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    stacked = torch.randn(L, k, n, generator=gen).to(torch.bfloat16)
    plan = make_plan("row_slice", m, n, 1, 16, 32, groups=1)
    tiles = plan.tiles.clone()
    tiles[:, EXPERT] = tiles[:, 0] // 16
    outs = []
    for w in (stacked.transpose(1, 2), stacked.transpose(1, 2).contiguous()):
        out = torch.full(plan.staging_shape, float("nan"), dtype=torch.bfloat16)
        signaled_gemm(a, w, out, tiles, None, 3, CONFIG)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = torch.cat([a[16 * l:16 * l + 16].double() @ stacked[l].double() for l in range(L)])
    assert float((outs[0].double() - ref).norm() / ref.norm()) < 1e-2
    with pytest.raises(ValueError, match="multiple of block_k"):
        signaled_gemm(a[:, :24].contiguous(), stacked[:, :24].contiguous().transpose(1, 2), out, tiles, None, 3,
                      CONFIG)
    with pytest.raises(ValueError, match="row-major"):
        from overlap_tp.kernels.signaled_gemm import check_operands
        check_operands(a, torch.randn(2 * n, k).to(torch.bfloat16)[::2])


def test_row_tiles_run_the_tiles_of_their_expanded_table():
    """A grouped GEMM (3 experts, 4 groups, one empty, segments that end mid-tile, N not a multiple of the tile)
    given as row tiles: the kernel stores the same bits as with the expanded table, raises each group's counter by
    its tile count, and with flags waits only where a group's WAIT names one (flags raised: no wait blocks)."""
    from overlap_tp.kernels.signaled_gemm import DST_ROW, EXPERT, GROUP, NO_WAIT, SRC_ROW, SRC_ROW_END, TILE_FIELDS, \
        WAIT, RowTiles
    gen = torch.Generator().manual_seed(11)
    experts, n, k, bm = 3, 72, 32, CONFIG.block_m
    w = torch.randn(experts, n, k, generator=gen).to(torch.bfloat16)
    segments = [(0, 0, 21), (1, 21, 37), (2, 37, 37), (0, 37, 70), (2, 70, 96)]   # (expert, rows lo, hi)
    groups = [[0, 1], [], [2, 3], [4]]                                                 # segments per group
    rows, starts = [], [0]
    for g, members in enumerate(groups):
        for s in members:
            expert, lo, hi = segments[s]
            for r in range(lo, hi, bm):
                row = [0] * TILE_FIELDS
                row[SRC_ROW], row[SRC_ROW_END], row[DST_ROW] = r, min(r + bm, hi), r
                row[GROUP], row[EXPERT], row[WAIT] = g, expert, g - 1 if g else NO_WAIT
                rows.append(row)
        starts.append(len(rows))
    table = RowTiles(torch.tensor(rows, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                     -(-n // CONFIG.block_n), 2)
    moved = table.to(torch.clone)   # rows and starts in one copy, as the expert ops move a table to the GPU
    assert torch.equal(moved.rows, table.rows) and torch.equal(moved.starts, table.starts)
    assert moved.starts.data_ptr() % 16 == 0 and moved.rows.is_contiguous()
    a = torch.randn(96, k, generator=gen).to(torch.bfloat16)
    ref = torch.cat([a[lo:hi].double() @ w[e].double().t() for e, lo, hi in segments])
    flags = torch.ones(len(groups), dtype=torch.int32)
    outs = []
    for tiles in (moved, table.expanded(CONFIG.block_n)):
        out = torch.full((96, n), float("nan"), dtype=torch.bfloat16)
        counters = torch.zeros(len(groups), dtype=torch.int32)
        signaled_gemm(a, w, out, tiles, counters, 3, CONFIG, flags=flags, wait_target=1)
        assert counters.tolist() == table.group_tiles()
        assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_specialization_key_separates_what_triton_specializes():
    """The compiled-kernel key of a launch (its GPU check against Triton's binder: tests/gpu/test_direct_launch_gpu.py)
    separates integers equal to 1, divisible by 16 or wider than 32 bits, pointers' alignment and dtype, the
    constexprs and the options; integers of one class share a key."""
    from overlap_tp.kernels.signaled_gemm import _CONSTEXPRS, specialization_key
    a, w = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(48, 32, dtype=torch.bfloat16)
    dst = torch.zeros(64, 48, dtype=torch.bfloat16)
    constexprs = (0,) * len(_CONSTEXPRS)
    options = dict(num_stages=3, num_warps=8)

    def key(n, ptr=dst, consts=constexprs, opts=options, aa=a):
        return specialization_key(0, aa, w, (ptr, n) + consts, opts)
    assert key(17) == key(33) and key(32) == key(48)
    assert len({key(1), key(2), key(16), key(2 ** 31 + 16)}) == 4
    assert key(17) != key(17, ptr=dst.view(-1)[1:])                       # 16-byte alignment
    assert key(17) != key(17, ptr=dst.half())                            # dtype
    assert key(17) != key(17, consts=(1,) + constexprs[1:])              # a constexpr
    assert key(17) != key(17, opts=dict(num_stages=4, num_warps=8))      # an option
    assert key(17) != key(17, aa=torch.zeros(65, 32, dtype=torch.bfloat16))   # a descriptor's shape (safe side)


def test_routings_share_one_compiled_kernel():
    """Row-tile plans of different routings (group counts 2-9, tile counts 1, 17, 32, 1000: Triton's classes of an
    integer) launch with the same specialization key, grid and constexprs, so a new routing compiles nothing;
    a dense plan's grid still stops at its tile count."""
    from overlap_tp.kernels.signaled_gemm import (_CONSTEXPRS, ROUTING_INTS, TILE_FIELDS, RowTiles, _plain_args,
                                                  signaled_gemm_kernel, specialization_key)
    kernel = signaled_gemm_kernel   # under the interpreter the decorator's arguments are kept in kwargs
    unspecialized = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"]
    assert {kernel.arg_names[i] if isinstance(i, int) else i for i in unspecialized} == set(ROUTING_INTS)
    a, w = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(3, 48, 32, dtype=torch.bfloat16)
    dst = torch.zeros(64, 48, dtype=torch.bfloat16)
    keys, launches = set(), set()
    for groups, row_tiles in ((1, 1), (2, 17), (5, 32), (8, 1000)):
        starts = torch.tensor([0] * groups + [row_tiles], dtype=torch.int32)
        tiles = RowTiles(torch.zeros(row_tiles, TILE_FIELDS, dtype=torch.int32), starts, 2, 4)
        for target in (1, 2, 16):
            grid, rest, options = _plain_args(a, w, dst, tiles, torch.zeros(groups + 1, dtype=torch.int32), 132,
                                              CONFIG, None, (0, row_tiles * 16), None,
                                              torch.zeros(groups, dtype=torch.int32), target)
            keys.add(specialization_key(0, a, w, rest, options))
            launches.add((grid, tuple(rest[-len(_CONSTEXPRS):])))
    assert len(keys) == 1 and len(launches) == 1, (keys, launches)
    grid, _, _ = _plain_args(a, w[0], dst, torch.zeros(5, TILE_FIELDS, dtype=torch.int32), None, 132, CONFIG, None,
                             (0, 0), None, None, 0)
    assert grid == 5
