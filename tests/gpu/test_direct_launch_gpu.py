"""The direct launch of compiled Triton kernels (kernels/direct_launch.py) on ONE GPU: SignaledGemm and SumSlots store
the same bits as Triton's JIT launch for every variant (weight read as stored or transposed, bias, stacked expert
weights through row tiles), the descriptor cache follows the tensors it describes (a new tensor at a freed one's
address, a new shape), the CompiledKernel.run fallback stores the same bits and says so, and a captured launch
replays with fresh inputs. Run: `pytest -m gpu tests/gpu/test_direct_launch_gpu.py`."""
import pytest
import torch

from gpu_checks import rel_error
from overlap_tp import OverlapConfig
from overlap_tp.kernels import direct_launch
from overlap_tp.kernels import signaled_gemm as S
from overlap_tp.kernels.sum_slots import SumSlots, reference_sum_slots
from overlap_tp.ops.plan_base import gemm_programs
from overlap_tp.ops.resolve import fill_defaults
from overlap_tp.ops.moe_tile_plan import dispatch_plan, layout
from overlap_tp.ops.tile_plan import make_plan

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda", 0)
CONFIG = fill_defaults(OverlapConfig(method="signal", transport="nccl"), "gemm_rs", DEV, 1)   # every field set


def dense_gemm(m, n, config=CONFIG, **kwargs):
    plan = make_plan(config.schedule, m, n, 1, config.block_m, config.block_n, config.groups, 2)
    dst = torch.empty(plan.staging_shape, dtype=torch.bfloat16, device=DEV)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=DEV)
    gemm = S.SignaledGemm(plan.tiles.to(DEV), gemm_programs(DEV, config), config, counters=counters, **kwargs)
    return gemm, plan, dst, counters


def jit_result(gemm, a, w, dst, bias=None):
    out = torch.full_like(dst, float("nan"))
    S.signaled_gemm(a, w, out, gemm.tiles, gemm.counters, gemm.num_programs, gemm.config, bias, gemm.bias_rows,
                    gemm.dst_offsets, gemm.flags, gemm.wait_target)
    return out


def direct_result(gemm, a, w, dst, bias=None):
    dst.fill_(float("nan"))
    gemm(a, w, dst, bias)
    return dst.clone()


@pytest.mark.parametrize("m, n, k", [(4096, 4096, 2048), (1000, 1408, 1024), (384, 200, 136)])
def test_signaled_gemm_direct_launch_equals_the_jit_launch(m, n, k):
    gen = torch.Generator(device=DEV).manual_seed(m + n + k)
    gemm, plan, dst, _ = dense_gemm(m, n, bias_rows=(0, m))
    a = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
    w = (torch.randn(n, k, device=DEV, generator=gen) / k ** 0.5).bfloat16()
    w_kn = (torch.randn(k, n, device=DEV, generator=gen) / k ** 0.5).bfloat16()   # read in place as w_kn.t()
    bias = torch.randn(n, device=DEV, generator=gen).bfloat16()
    for weight, b in ((w, None), (w_kn.t(), None), (w, bias), (w_kn.t(), bias)):
        want = jit_result(gemm, a, weight, dst, b)
        for launch_no in range(3):   # the first launches compile or look the kernel up; later ones run direct
            got = direct_result(gemm, a, weight, dst, b)
            assert torch.equal(got, want), (weight.stride(), b is not None, launch_no)
        assert not want.isnan().any()
    assert all(kernel.direct for kernel, _, _ in gemm._variants.values())
    assert len(gemm._variants) == 4


def test_descriptor_cache_follows_the_tensors():
    """A launch never reads through a stale descriptor: new data at a freed tensor's address gives the new product,
    and the same address with another shape (a longer view of one buffer) is another descriptor."""
    m, n, k = 2048, 1024, 512
    gen = torch.Generator(device=DEV).manual_seed(1)
    gemm, plan, dst, _ = dense_gemm(m, n)
    w = (torch.randn(n, k, device=DEV, generator=gen) / k ** 0.5).bfloat16()
    addresses = set()
    for i in range(6):
        a = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
        addresses.add(a.data_ptr())
        assert torch.equal(direct_result(gemm, a, w, dst), jit_result(gemm, a, w, dst)), i
        del a   # the next tensor is likely handed the same block by the caching allocator
    (kernel, _, _), = gemm._variants.values()
    assert 0 < len(kernel._descriptors) <= direct_launch.MAX_CACHED_DESCRIPTORS
    buf = torch.randn(2 * m, k, device=DEV, generator=gen).bfloat16()
    box = [CONFIG.block_m, CONFIG.block_k]
    short, long = kernel.tma(0, buf[:m], box), kernel.tma(0, buf, box)
    assert short[1:] == (m, k, k, 1) and long[1:] == (2 * m, k, k, 1) and short[0] is not long[0]
    assert kernel.tma(0, buf[:m], box) is short   # a hit


def test_row_tiles_over_stacked_expert_weights_equal_the_jit_launch():
    experts, hidden, ffn = 4, 1024, 1536
    counts = torch.tensor([[700, 0, 2500, 300]])   # an expert with no rows, rows not multiples of the tile
    lay = layout(counts, 0)
    host = dispatch_plan(lay, 2 * ffn, CONFIG.block_m, CONFIG.block_n, 1).tiles
    tiles = S.RowTiles(host.rows.to(DEV), host.starts.to(DEV), host.n_tiles, host.raster_m)
    gen = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(int(counts.sum()), hidden, device=DEV, generator=gen).bfloat16()
    w = (torch.randn(experts, 2 * ffn, hidden, device=DEV, generator=gen) / hidden ** 0.5).bfloat16()
    out = torch.empty(x.shape[0], 2 * ffn, device=DEV, dtype=torch.bfloat16)
    gemm = S.SignaledGemm(tiles, gemm_programs(DEV, CONFIG), CONFIG)
    want = jit_result(gemm, x, w, out)
    for _ in range(3):
        assert torch.equal(direct_result(gemm, x, w, out), want)
    lo = 0
    for e, rows in enumerate(counts[0].tolist()):
        ref = x[lo:lo + rows].float() @ w[e].float().t()
        if rows:
            assert rel_error(want[lo:lo + rows], ref) < 1e-2, e
        lo += rows


@pytest.mark.parametrize("max_launches", [S.MAX_CACHED_LAUNCHES, 2])
def test_launch_checked_follows_the_addresses(max_launches, monkeypatch):
    """A plan's launches (launch_checked: the arguments kept by the tensors' addresses and w's layout) store the JIT
    launch's bits: new data at a freed tensor's address, both weight layouts, a bias, a destination at another address,
    and with a cache so small that it is cleared on the way."""
    monkeypatch.setattr(S, "MAX_CACHED_LAUNCHES", max_launches)
    m, n, k = 2048, 1024, 512
    gen = torch.Generator(device=DEV).manual_seed(7)
    gemm, _, dst, _ = dense_gemm(m, n, bias_rows=(0, m))
    w = (torch.randn(n, k, device=DEV, generator=gen) / k ** 0.5).bfloat16()
    w_kn = (torch.randn(k, n, device=DEV, generator=gen) / k ** 0.5).bfloat16()
    bias = torch.randn(n, device=DEV, generator=gen).bfloat16()
    other_dst = torch.empty_like(dst)
    for i in range(12):
        a = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
        weight, b, into = ((w, None, dst), (w_kn.t(), None, dst), (w, bias, other_dst), (w_kn.t(), bias, dst))[i % 4]
        want = jit_result(gemm, a, weight, into, b)
        into.fill_(float("nan"))
        gemm.launch_checked(a, weight, into, b)
        assert torch.equal(into, want), (i, weight.stride(), b is not None)
        del a   # the next tensor is likely handed the same block by the caching allocator
    assert 0 < len(gemm._launches) <= max_launches


def test_sum_slots_launch_checked_equals_the_reference():
    """A plan's sums (SumSlots.launch_checked: arguments made once per slots buffer) equal the reference, into fresh
    outputs, and a second slots buffer is bound in its turn."""
    gen = torch.Generator(device=DEV).manual_seed(8)
    t, numel = 2, 1024 * 1000
    op = SumSlots(t, numel)
    for slots in (torch.randn(t, numel, device=DEV, generator=gen).bfloat16() for _ in range(2)):
        want = reference_sum_slots(slots)
        for _ in range(3):
            out = torch.full((numel,), float("nan"), device=DEV, dtype=torch.bfloat16)
            assert op.launch_checked(slots, out) is out
            assert torch.equal(out, want)
        assert op._bound[0] is slots


def test_the_compiled_kernel_run_fallback_stores_the_same_bits(monkeypatch):
    m, n, k = 1024, 768, 256
    gen = torch.Generator(device=DEV).manual_seed(3)
    a = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
    w = (torch.randn(n, k, device=DEV, generator=gen) / k ** 0.5).bfloat16()
    gemm, _, dst, _ = dense_gemm(m, n)
    for _ in range(2):
        want = direct_result(gemm, a, w, dst)
    (variant, (kernel, grid, rest)), = gemm._variants.items()
    monkeypatch.setattr(direct_launch, "DIRECT_LAYOUT", "not Triton 3.6")
    with pytest.warns(UserWarning, match="launches through Triton's CompiledKernel.run"):
        fallback = direct_launch.DirectKernel(kernel.compiled)
    assert not fallback.direct
    monkeypatch.setitem(gemm._variants, variant, (fallback, grid, rest))
    assert torch.equal(direct_result(gemm, a, w, dst), want)


def test_sum_slots_direct_launch_equals_the_reference():
    gen = torch.Generator(device=DEV).manual_seed(4)
    for t, numel in ((2, 4096 * 4096), (4, 12345)):
        slots = torch.randn(t, numel, device=DEV, generator=gen).bfloat16()
        op = SumSlots(t, numel)
        want = reference_sum_slots(slots)
        for _ in range(3):
            out = torch.full((numel,), float("nan"), device=DEV, dtype=torch.bfloat16)
            op(slots, out)
            assert torch.equal(out, want), (t, numel)
        assert all(kernel.direct for kernel in op._compiled.values())


def test_captured_direct_launch_replays_with_fresh_inputs():
    m, n, k = 2048, 2048, 1024
    gen = torch.Generator(device=DEV).manual_seed(5)
    gemm, _, dst, counters = dense_gemm(m, n)
    a = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
    w = (torch.randn(n, k, device=DEV, generator=gen) / k ** 0.5).bfloat16()
    for _ in range(2):
        gemm(a, w, dst)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(a, w, dst)
    for i in range(20):
        a.copy_(torch.randn(m, k, device=DEV, generator=gen))
        graph.replay()
        assert torch.equal(dst, jit_result(gemm, a, w, dst)), i


def test_the_specialization_key_is_at_least_as_fine_as_tritons():
    """Launches that share a specialization_key share Triton's own specialization (its binder's), so the compiled
    kernel found by the key is the one Triton's JIT would run: over dense plans of many shapes, both weight layouts,
    bias or not, and row tiles of many routings."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    gemm, _, dst, _ = dense_gemm(256, 256)
    gemm(torch.randn(256, 64, device=DEV).bfloat16(), torch.randn(256, 64, device=DEV).bfloat16(), dst)
    binder = S.signaled_gemm_kernel.device_caches[0][-1]
    constexprs = len(S._CONSTEXPRS)
    seen, cases = {}, 0

    def check(gemm, a, w, dst, bias=None):
        nonlocal cases
        grid, rest, options = S._plain_args(a, w, dst, gemm.tiles, gemm.counters, gemm.num_programs, gemm.config,
                                            bias, gemm.bias_rows, gemm.dst_offsets, gemm.flags, gemm.wait_target)
        args = S._descriptors(a, w, gemm.config) + rest
        _, spec, _ = binder(*args[:-constexprs], **dict(zip(S._CONSTEXPRS, args[-constexprs:])), **options)
        key = S.specialization_key(0, a, w, rest, options)
        assert seen.setdefault(key, list(spec)) == list(spec), key
        cases += 1

    for m in (16, 1000, 1024, 4096):
        for n, k in ((200, 136), (1408, 1024), (4096, 2048)):
            gemm, _, dst, _ = dense_gemm(m, n, bias_rows=(0, m))
            a = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
            w = torch.randn(n, k, device=DEV, generator=gen).bfloat16()
            w_kn = torch.randn(k, n, device=DEV, generator=gen).bfloat16()
            bias = torch.randn(n, device=DEV, generator=gen).bfloat16()
            for weight in (w, w_kn.t()):
                for b in (None, bias):
                    check(gemm, a, weight, dst, b)
    experts, hidden, n = 4, 1024, 3072
    w = torch.randn(experts, n, hidden, device=DEV, generator=gen).bfloat16()
    for seed in range(12):
        counts = torch.randint(0, 1500, (1, experts), generator=torch.Generator().manual_seed(seed))
        lay = layout(counts, 0)
        host = dispatch_plan(lay, n, CONFIG.block_m, CONFIG.block_n, 1).tiles
        tiles = S.RowTiles(host.rows.to(DEV), host.starts.to(DEV), host.n_tiles, host.raster_m)
        x = torch.randn(max(1, lay.rows), hidden, device=DEV, generator=gen).bfloat16()
        out = torch.empty(x.shape[0], n, device=DEV, dtype=torch.bfloat16)
        check(S.SignaledGemm(tiles, gemm_programs(DEV, CONFIG), CONFIG), x, w, out)
    assert cases == 60 and len(seen) > 4


@pytest.mark.parametrize("rows, hidden, ordered, dropout_p, slots", [
    (2048, 4096, False, 0.0, 0), (1000, 1024, False, 0.1, 0), (4096, 4096, True, 0.1, 0), (2048, 4096, False, 0.0, 2)])
def test_norm_kernels_through_the_jit_launcher_equal_their_first_launch(rows, hidden, ordered, dropout_p, slots):
    """The fused add + RMSNorm's kernels (forward, backward, the partial sums, the dropout mask) through JitLauncher:
    the first launch of each specialization goes through Triton's JIT, the later ones through DirectKernels; every
    launch writes the same bits."""
    from overlap_tp.kernels import fused_add_rmsnorm as N
    gen = torch.Generator(device=DEV).manual_seed(rows + hidden + slots)
    x = torch.randn(rows, hidden, device=DEV, generator=gen).bfloat16()
    x_slots = torch.randn(slots, rows, hidden, device=DEV, generator=gen).bfloat16() if slots else None
    residual = (4 * torch.randn(rows, hidden, device=DEV, generator=gen)).bfloat16()
    weight = (1 + 0.5 * torch.randn(hidden, device=DEV, generator=gen)).bfloat16()
    bias = (0.5 * torch.randn(hidden, device=DEV, generator=gen)).bfloat16()
    dy = torch.randn(rows, hidden, device=DEV, generator=gen).bfloat16()
    order = None
    if ordered:
        tiles = (rows // 128) * (hidden // 256)
        slot_of = torch.randperm(tiles, generator=gen, device=DEV).to(torch.int32).reshape(rows // 128, hidden // 256)
        order = N.TileOrder(128, 256, slot_of)
    seed = N.dropout_seed(DEV)
    options = dict(dropout_p=dropout_p, seed=seed if dropout_p else None)
    results = []
    for _ in range(3):
        out = N.ForwardOutputs(*(t.fill_(float("nan")) for t in N.empty_forward_outputs(x, residual, torch.bfloat16)))
        N.launch_forward(x, residual, weight, bias, out, eps=1e-5, x_order=order, x_slots=x_slots, **options)
        ds = torch.full_like(residual, float("nan"))
        dx = torch.full_like(x, float("nan"))
        sums = N.launch_backward(dy, None, out.residual_out, out.rstd, weight, ds, dx, dy_order=order, dx_order=order,
                                 bias_grad=True, **options)
        keep = N.dropout_keep_mask(seed, rows, hidden, dropout_p) if dropout_p else None
        results.append((*out, ds, dx, *sums) + ((keep,) if keep is not None else ()))
    for later in results[1:]:
        for i, (first, again) in enumerate(zip(results[0], later)):
            assert torch.equal(first, again), i
    assert not results[0][0].isnan().any() and not results[0][3].isnan().any()
    for launcher in (N._forward, N._backward, N._sum_partials) + ((N._dropout_mask,) if dropout_p else ()):
        assert launcher._kernels and all(kernel.direct for kernel in launcher._kernels.values())
